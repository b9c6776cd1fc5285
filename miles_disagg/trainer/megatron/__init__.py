"""``--train-backend megatron``: megatron-core GPTModel, HF <-> megatron conversion, CPU support.

Nothing here is imported unless the megatron backend is chosen (megatron-core is an
optional dependency: ``pip install 'miles-disagg[megatron]'``).
"""
