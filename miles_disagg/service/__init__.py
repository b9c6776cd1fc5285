"""The external rollout service: one endpoint, a version store, self-converging replicas.

The trainer never holds a handle to a replica. It talks to two things:

* **The version store** (``--update-weight-disk-dir``): it publishes versions there
  (``DeltaPublisher.publish``, or ``miles-disagg weights publish``). Replicas follow the
  store's ``LATEST`` by themselves; nothing else is needed for a version to reach them.
* **The gateway URL** (``--rollout-service-url``): exactly the router's request contract.
  ``POST {url}/generate`` with the SGLang body plus ``"weight_version": {"min_version": N}``
  (staleness bound) or ``{"exact_version": N}`` (evaluation), or the headers
  ``X-Weight-Version-Min``/``X-Weight-Version-Exact``. Answers:

  - ``200``: the engine's answer; every item has ``meta_info.weight_version_start`` and
    ``weight_version_end`` (ints; they differ when the replica activated a newer version
    while the request was in flight) and ``meta_info.routed_worker``. Record these on
    the sample; never infer them from the trainer's counter.
  - ``409 {"type": "WeightVersionNotReady", "retryable": true, "required", "available_versions"}``
    with ``Retry-After``: no ready replica satisfies the constraint yet (e.g. the version is
    still being staged). Retry after the advised wait; nothing was generated.
  - ``503 {"type": "NoWorkerAvailable", "retryable": true}`` with ``Retry-After``: no replica
    is ready at all. Nothing was generated; retry.
  - ``502 {"type": "WorkerFailed", "retryable": true}``: the replica failed while serving;
    generation may have started, so replay only requests that are idempotent.

  Optional: ``POST {url}/wake`` right after publishing makes every replica look at the store
  now instead of at its next poll (``--poll-interval``, 1 s by default; 0.5 s in local
  pools). ``GET {url}/service_metrics`` reports convergence, pause/prepare times, version lag.

Starting a local service from Python (a gateway plus N replica processes with built-in
engines; returns once every replica is ready at the store's newest version)::

    from miles_disagg.service.local import launch_local_service

    service = launch_local_service(store_dir, base_dir, work_dir=log_dir, num_replicas=2, port=0)
    try:
        url = service.url            # give this to the rollout as --rollout-service-url
        ...                          # publish into store_dir; requests to url
    finally:
        service.stop()

Modules (dependencies point down): ``cli`` -> ``local``/``ray_pool`` -> ``launch`` ->
``replica`` -> ``reconciler`` (pure state machine) + ``adapters`` (store, engine, gateway
ports) + ``engines.launch`` (run one engine); ``gateway`` -> ``fleet`` (pure replica
table) + ``metrics`` (pure); ``scaling`` (pure policy); ``protocol`` (pure heartbeat types);
``client`` (``GatewayClient``). Importing this package imports nothing else.
"""
