"""The names of the files a run writes into its run directory (``--run-dir``), besides the metrics
and streams :mod:`miles_disagg.tracking` names (``metrics.jsonl``, ``<stream>.jsonl``).

A leaf: it imports nothing of the package, so the modules that write a file and those that read it
back (the run, the report, ``miles-disagg report``) share one name without importing each other.
The engine manager rewrites ``placement.json`` on membership changes and names it itself
(:mod:`miles_disagg.fleet.membership`, a lower room than ``loop``)."""

CONFIG_FILENAME = "config.json"
"""The resolved configuration of the run's command (written before anything starts)."""

PLACEMENT_FILENAME = "placement.json"
"""Where every trainer rank, engine, the router and the driver ran (:mod:`miles_disagg.loop.cluster`)."""

ENGINE_EVENTS_FILENAME = "engine_events.json"
"""What happened to the engines during the run, written when the run stops (:mod:`miles_disagg.loop.cluster`)."""

EVENTS_STREAM = "events"
"""``<run_dir>/events.jsonl``: one record per trainer restart, never rewound
(:mod:`miles_disagg.loop.trainer_restart`)."""

SUMMARY_FILENAME = "summary.json"
"""The end-of-run summary (:mod:`miles_disagg.loop.report`)."""

REPORT_FILENAME = "report.png"
"""The end-of-run plots (:mod:`miles_disagg.loop.report`)."""
