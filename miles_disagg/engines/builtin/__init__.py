"""Built-in rollout engine: a CPU-friendly server that speaks SGLang's HTTP API.

Modules (dependencies point down): ``cli`` (flags) -> ``server`` (FastAPI app) ->
``response`` (SGLang's ``/generate`` response shape) ->
``scheduler`` (continuous batching, pause modes, activation between steps) ->
``forward_passes`` (each step's model calls) -> ``sequence`` (a request in flight) ->
``model_runner`` (HF model, batched KV cache), ``sampling``, ``staging`` (pulled weights
held in RAM), ``dist_update`` (torch.distributed weight-update group), ``protocol``
(``/generate``'s body), ``control_bodies`` (the control endpoints' bodies) and ``bodies`` (their strict
base), with SGLang's field names. Nothing heavy is imported here.
"""
