"""What a run records and checks about the cluster, without Ray: the store probe, the node
watch that ends a run whose node left, and absolute paths for actors on other nodes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_disagg.config.components import RunConfig
from miles_disagg.loop.preflight import make_paths_absolute
from miles_disagg.loop.cluster import NodeWatch
from miles_disagg.remote import add_watch, remove_watch, run_watches
from miles_disagg.types import NodeLost
from miles_disagg.weights.probe import read_probe, remove_probe, write_probe
from miles_disagg.weights.store import VersionStore


def test_the_store_probe_reads_back_where_the_store_is_the_same(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "store")
    assert read_probe(probe) is None
    assert VersionStore(tmp_path / "store").visible_versions() == []  # readers ignore it
    remove_probe(probe)
    assert list((tmp_path / "store").iterdir()) == []


def test_the_store_probe_names_what_another_node_would_find(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "store")
    remove_probe(probe)  # an empty directory of the same name: not the trainer's
    assert "is not the trainer's" in read_probe(probe)
    (tmp_path / "store").rmdir()
    assert read_probe(probe) == "no such directory"
    probe.path.parent.mkdir()
    probe.path.write_text("0123")
    assert read_probe(probe) == "the probe file there holds another token (a different store)"


WORK = {"n1" * 28: {"node_ip": "10.0.0.1", "work": ["trainer rank 0"]},
        "n2" * 28: {"node_ip": "10.0.0.2", "work": ["engine 0", "engine 1"]}}


def test_the_node_watch_is_quiet_while_every_node_is_alive() -> None:
    watch = NodeWatch(WORK, alive_nodes=lambda: set(WORK) | {"other"})
    watch()


def test_the_node_watch_names_the_lost_node_and_what_ran_there() -> None:
    alive = set(WORK)
    watch = NodeWatch(WORK, alive_nodes=lambda: set(alive), interval_s=0)
    watch()
    alive.discard("n2" * 28)
    with pytest.raises(NodeLost) as lost:
        watch()
    assert str(lost.value) == (f"node 10.0.0.2 (id {'n2' * 28}) left the Ray cluster; engine 0, engine 1 ran there, "
                               "so the run cannot go on")
    assert (lost.value.node_ip, lost.value.node_id) == ("10.0.0.2", "n2" * 28)
    alive.add("n2" * 28)
    with pytest.raises(NodeLost):  # a lost node stays lost for the run
        watch()


def test_registered_watches_run_until_removed() -> None:
    def watch() -> None:
        raise NodeLost("gone")

    add_watch(watch)
    try:
        with pytest.raises(NodeLost):
            run_watches()
    finally:
        remove_watch(watch)
    run_watches()


def test_paths_handed_to_actors_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = RunConfig()
    config.tracking.run_dir = "runs/x"
    config.train.hf_checkpoint = "base"
    config.weights.update_weight_disk_dir = "/shared/store"
    config.weights.update_weight_local_checkpoint_dir = "local"
    make_paths_absolute(config)
    assert config.tracking.run_dir == os.path.join(tmp_path, "runs/x")
    assert config.train.hf_checkpoint == os.path.join(tmp_path, "base")
    assert config.weights.update_weight_disk_dir == "/shared/store"
    assert config.weights.update_weight_local_checkpoint_dir == os.path.join(tmp_path, "local")
    assert config.train.save is None
