"""``miles-disagg relay``: one WAN copy of each version per region (see :mod:`.cache` and :mod:`.app`)."""
