"""``miles-disagg agent``: ``/pull_weights`` in front of a stock SGLang engine, no fork needed.

A small process on the engine's host. It materializes published versions into the
host-local checkpoint with the weights package's ``Materializer`` (A/B slots, every
changed tensor verified, lineage enforced) while the engine keeps serving, points
``/update_weights_from_disk`` naming that version at the directory holding exactly it,
and proxies every other request to the engine unchanged.

Modules: ``state`` (the agent's host state: held version, pulls, activations), ``app`` (its HTTP
app), ``cli`` (flags); :func:`miles_disagg.engines.launch.launch_agent` starts one as a subprocess.
Nothing heavy is imported here.
"""
