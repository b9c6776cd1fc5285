"""Versioned weight publication: the disk-delta format, the version store, host materialization.

On-disk layout of a store (``--update-weight-disk-dir``)::

    LATEST                              {"run_id": ..., "version": N}; replaced last, atomically
    weight_vNNNNNN/
      model.safetensors.index.json      {"metadata": {version, base_version, delta_encoding,
                                          compression_format, checksum_format, run_id, filter,
                                          chunk_bytes, tensors: {name: dtype/shape/nbytes[/encoding]}, ...},
                                         "weight_map": {hf_name: payload file}}
      model-00000-of-0000K.safetensors  one 1-D uint8 payload per changed tensor; __metadata__
                                        maps each name to the checksum of its FULL new bytes
                                        (one or more files per writing trainer rank)

Encodings: ``xor`` (default; applies exactly once onto its base), ``overwrite``
(``[u32 count][u32 positions][new bytes]``; idempotent), ``full`` (periodic anchors) and
``mixed`` (what ``xor`` with byte planes publishes: each tensor the smallest of ``xor``,
``overwrite`` and ``sparse`` gap-coded positions + XOR values, named per tensor in
``tensors``; see ``mixed`` and ``sparse``).
Compression: zstd level 1. Filter ``byteplane`` (default) cuts tensors into 4 MiB
chunks and splits 2-byte dtypes into low/high byte planes, each its own zstd frame
(sparse planes as a bitmap of changed positions plus the changed bytes; see ``codec``);
``none`` writes the plain format other disk-delta producers write (one zstd frame per
tensor; miles' publisher, SGLang's /pull_weights applier: see ``format``). ``full`` anchors
are this project's extension: SGLang's applier knows only ``xor``/``overwrite`` deltas and
ordinary checkpoints, so a store meant for it keeps anchors off (the default).
Checksums: ``xxh3-128`` (default), ``blake3``, ``adler32`` (lowercase hex digests).

Public API (import from the submodules; this package imports nothing heavy):

* ``publisher.DeltaPublisher`` / ``PublishResult``: trainer side (``capture_baseline``, ``publish``);
  sharded over the trainer's ranks with ``share`` and ``collective``: ``shares`` (who owns which
  tensor, writing a rank's share), ``commit`` (gathering the manifests, the one commit).
* ``materializer.Materializer`` / ``PreparedVersion``: host side (``prepare``, ``prepare_in_memory``, ``held``).
* ``store.VersionStore``: pointer, visible versions, chain planning, commit protocol, ``prune``.
* ``codec``: per-tensor encode/decode over a thread pool; ``format``: index parsing/validation.
* ``cli``: ``miles-disagg weights publish|apply|verify|inspect``.
"""
