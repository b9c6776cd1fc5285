"""Version-aware router: worker registry, health checks, routing by weight version, proxy.

``miles-disagg router`` runs it (:mod:`.cli`, app in :mod:`.app`, the
router itself in :mod:`.proxy`, settings in :mod:`.config`);
:func:`miles_disagg.router.launch.launch_router` starts it as a subprocess;
:class:`miles_disagg.router.client.RouterClient` drives its registry. The pure parts,
:mod:`.registry` and :mod:`.policy`, do no I/O. Importing this package imports nothing else.
"""
