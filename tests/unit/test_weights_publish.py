"""Publisher + store: format, commit protocol, crashes, races, hooks, anchors and retention."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_disagg.types import ConfigError, InvalidInput, LayoutMismatch, PublishConflict, VersionNotReady, VersionRef
from miles_disagg.weights.format import INDEX_NAME, read_index
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.safetensors_io import read_header
from miles_disagg.weights.store import VersionStore
from weights_fixtures import write_checkpoint

REPO = Path(__file__).resolve().parents[2]


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": (torch.randn(64, 32, generator=g) * 0.02).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(48, 32, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(32),
        "model.counts": torch.arange(10, dtype=torch.int64),
    }


def step(tensors: dict[str, torch.Tensor], names: tuple[str, ...], scale: float = 1e-2) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for name in names:
        t = out[name]
        out[name] = (t.float() + scale * torch.randn(t.shape)).to(t.dtype)
    return out


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "base", base_tensors())


def publisher(store: Path, base: Path, **kwargs) -> DeltaPublisher:
    pub = DeltaPublisher(store, base_dir=base, **kwargs)
    pub.capture_baseline()
    return pub


def held_tensors(local: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(local / "model.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def test_first_publish_is_version_1_on_base_0_and_writes_the_documented_format(tmp_path, base):
    store = tmp_path / "store"
    pub = publisher(store, base, run_id="run-a")
    assert not store.exists() or not (store / "LATEST").exists()  # capturing publishes nothing
    result = pub.publish(step(base_tensors(), ("model.layers.0.mlp.up_proj.weight",)).items())
    assert result.ref == VersionRef("run-a", 1)
    assert json.loads((store / "LATEST").read_text()) == {"run_id": "run-a", "version": 1}
    index = json.loads((store / "weight_v000001" / INDEX_NAME).read_text())
    meta = index["metadata"]
    # xor with byte planes publishes ``mixed``: each tensor names the encoding it took
    assert (meta["version"], meta["base_version"], meta["delta_encoding"]) == ("000001", "000000", "mixed")
    assert (meta["compression_format"], meta["checksum_format"], meta["run_id"], meta["filter"]) == ("zstd", "xxh3-128", "run-a", "byteplane")
    assert list(index["weight_map"]) == ["model.layers.0.mlp.up_proj.weight"]  # unchanged tensors are not published
    layout = meta["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert layout.pop("encoding") in ("xor", "sparse", "overwrite")
    assert layout == {"dtype": "BF16", "shape": [48, 32], "nbytes": 3072}
    header = read_header(store / "weight_v000001" / index["weight_map"]["model.layers.0.mlp.up_proj.weight"])
    assert header.tensors["model.layers.0.mlp.up_proj.weight"].dtype == "U8"
    assert "model.layers.0.mlp.up_proj.weight" in header.metadata
    assert result.num_changed_tensors == 1 and 0 < result.density < 1 and result.wire_bytes > 0
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in base_tensors().values())
    assert not [p for p in store.iterdir() if p.name.startswith(".staging")]


@st.composite
def checkpoints(draw):
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8]
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True), min_size=1, max_size=5, unique=True))
    tensors = {}
    for i, name in enumerate(names):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(dtypes))
        g = torch.Generator().manual_seed(i)
        tensors[name] = (torch.randn(shape, generator=g) * 10).to(dtype)
    steps = draw(st.lists(st.lists(st.sampled_from(names), unique=True), min_size=1, max_size=3))
    return tensors, steps


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=checkpoints(), encoding=st.sampled_from(["xor", "overwrite"]), filt=st.sampled_from(["byteplane", "none"]),
       anchor=st.sampled_from([0, 2]))
def test_random_checkpoints_round_trip_through_store_and_host(tmp_path_factory, case, encoding, filt, anchor):
    tensors, steps = case
    root = tmp_path_factory.mktemp("rt")
    base = write_checkpoint(root / "base", tensors)
    pub = publisher(root / "store", base, encoding=encoding, filter=filt, full_anchor_interval=anchor, chunk_bytes=64)
    host = Materializer(root / "local", base_dir=base)
    current = dict(tensors)
    for names in steps:
        current = step(current, tuple(names), scale=1.0)
        pub.publish(current.items())
        prepared = host.prepare(root / "store")
        assert prepared.ref == pub.latest
        assert_same(held_tensors(root / "local"), current)
    fresh = Materializer(root / "fresh", base_dir=base)
    fresh.prepare(root / "store")
    assert_same(held_tensors(root / "fresh"), current)


def test_bad_publisher_configuration_names_the_flag(tmp_path, base):
    for kwargs, flag in (({"encoding": "rle"}, "--update-weight-delta-encoding"),
                         ({"checksum": "md5"}, "--update-weight-delta-checksum"),
                         ({"filter": "bitshuffle"}, "--update-weight-delta-filter"),
                         ({"post_write_hook": "no_such_module_xyz:fn"}, "--custom-update-weight-post-write-path"),
                         ({"post_write_hook": "json:no_such_fn"}, "--custom-update-weight-post-write-path"),
                         ({"post_write_hook": "os.path:join"}, None),  # join(a, *p) accepts (version_dir, ref)
                         ({"post_write_hook": "json:dumps"}, "--custom-update-weight-post-write-path"),
                         ({"post_write_hook": lambda: None}, "--custom-update-weight-post-write-path"),
                         # miles' own hook signature (args, version_dir, rollout_engines) is accepted
                         ({"post_write_hook": lambda args, path, rollout_engines: None}, None),
                         ({"post_write_hook": lambda a, b, c, d: None}, "--custom-update-weight-post-write-path")):
        if flag is None:
            DeltaPublisher(tmp_path / "s", base_dir=base, **kwargs)
            continue
        with pytest.raises(ConfigError) as info:
            DeltaPublisher(tmp_path / "s", base_dir=base, **kwargs)
        assert flag in str(info.value) and info.value.flags == (flag,)


def test_layout_mismatch_in_publish_leaves_the_store_unchanged(tmp_path, base):
    store = tmp_path / "store"
    pub = publisher(store, base)
    pub.publish(step(base_tensors(), ("model.norm.weight",)).items())
    before = (store / "LATEST").read_text()
    bad_cases = [
        {**base_tensors(), "model.norm.weight": torch.ones(33)},  # shape
        {**base_tensors(), "model.norm.weight": torch.ones(32, dtype=torch.float64)},  # dtype
        {**base_tensors(), "unknown.weight": torch.ones(2)},  # name
    ]
    for tensors in bad_cases:
        with pytest.raises(LayoutMismatch):
            pub.publish(tensors.items())
    assert (store / "LATEST").read_text() == before
    assert sorted(p.name for p in store.iterdir() if p.name.startswith("weight_v")) == ["weight_v000001"]
    with pytest.raises(InvalidInput, match="given twice"):  # an unchanged tensor sent twice
        pub.publish([("model.counts", base_tensors()["model.counts"])] * 2)
    assert (store / "LATEST").read_text() == before
    with pytest.raises(InvalidInput):
        DeltaPublisher(store, base_dir=base).publish(base_tensors().items())  # no baseline captured


def test_post_write_hook_runs_before_the_pointer_moves_and_can_abort(tmp_path, base):
    store = tmp_path / "store"
    seen = []

    def hook(version_dir, ref):
        seen.append((Path(version_dir).name, ref, (store / "LATEST").exists()))
        assert (Path(version_dir) / INDEX_NAME).exists()

    pub = publisher(store, base, post_write_hook=hook)
    pub.publish(step(base_tensors(), ("model.norm.weight",)).items())
    assert seen == [("weight_v000001", VersionRef(pub.run_id, 1), False)]

    def failing(version_dir, ref):
        raise RuntimeError("upload failed")

    pub2 = publisher(store, base, post_write_hook=failing)
    with pytest.raises(RuntimeError, match="upload failed"):
        pub2.publish(step(base_tensors(), ("model.counts",)).items())
    assert VersionStore(store).latest() == VersionRef(pub.run_id, 1)
    assert not (store / "weight_v000002").exists()
    pub2._post_write = None
    assert pub2.publish(step(base_tensors(), ("model.counts",)).items()).ref.version == 2  # retry from the same state


KILL_SCRIPT = """
import os, sys, torch
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.store import VersionStore
store, base, where = sys.argv[1], sys.argv[2], sys.argv[3]
def die(*_):
    os._exit(9)
pub = DeltaPublisher(store, base_dir=base, post_write_hook=die if where == "hook" else None)
pub.capture_baseline()
if where == "staging":
    VersionStore.commit = lambda *a, **k: os._exit(9)
from safetensors.torch import load_file
t = load_file(base + "/model.safetensors")
t["model.norm.weight"] = t["model.norm.weight"] + 1
pub.publish(t.items())
"""


@pytest.mark.parametrize("where", ["staging", "hook"])
def test_publisher_killed_before_the_pointer_moves_leaves_no_visible_version(tmp_path, base, where):
    store = tmp_path / "store"
    pub = publisher(store, base, run_id="r")
    pub.publish(step(base_tensors(), ("model.norm.weight",)).items())
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(store), str(base), where], cwd=REPO, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()
    s = VersionStore(store)
    assert s.latest() == VersionRef("r", 1) and s.visible_versions() == [1]
    with pytest.raises(VersionNotReady):
        s.read_index(2)
    host = Materializer(tmp_path / "local", base_dir=base)
    assert host.prepare(store).ref == VersionRef("r", 1)
    expected = step(base_tensors(), ("model.counts",))
    assert publisher(store, base).publish(expected.items()).ref == VersionRef("r", 2)  # the next publish succeeds
    assert host.prepare(store).ref == VersionRef("r", 2)
    assert not [p for p in store.iterdir() if p.name.startswith(".trash")]
    VersionStore(store).sweep(max_age_s=0)  # a dead publisher's staging dir is swept once stale
    assert not [p for p in store.iterdir() if p.name.startswith((".staging", ".trash"))]
    assert_same(held_tensors(tmp_path / "local"), {**expected, "model.norm.weight": held_tensors(tmp_path / "local")["model.norm.weight"]})


def test_two_publishers_racing_for_the_same_version_one_loses_cleanly(tmp_path, base):
    store = tmp_path / "store"
    pubs = [publisher(store, base, run_id="r") for _ in range(2)]
    updates = [step(base_tensors(), ("model.norm.weight",)), step(base_tensors(), ("model.counts",))]
    barrier = threading.Barrier(2)
    outcomes: list = [None, None]

    def stream(i):
        barrier.wait()
        yield from updates[i].items()

    def run(i):
        try:
            outcomes[i] = pubs[i].publish(stream(i))
        except PublishConflict as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i in range(2) if not isinstance(outcomes[i], PublishConflict)]
    losers = [i for i in range(2) if isinstance(outcomes[i], PublishConflict)]
    assert len(winners) == 1 and len(losers) == 1
    conflict = outcomes[losers[0]]
    assert conflict.expected is None and conflict.actual == VersionRef("r", 1)
    assert pubs[losers[0]].latest is None  # the loser's state did not advance
    assert VersionStore(store).visible_versions() == [1]
    assert not [p for p in store.iterdir() if p.name.startswith((".staging", ".trash"))]
    Materializer(tmp_path / "local", base_dir=base).prepare(store)
    assert_same(held_tensors(tmp_path / "local"), updates[winners[0]])


def test_publisher_restart_catches_up_and_other_runs_are_refused(tmp_path, base):
    store = tmp_path / "store"
    v1 = step(base_tensors(), ("model.norm.weight", "model.embed_tokens.weight"))
    publisher(store, base, run_id="r").publish(v1.items())
    v2 = step(v1, ("model.embed_tokens.weight",))
    restarted = publisher(store, base)  # run id adopted from the store, snapshot replayed to v1
    result = restarted.publish(v2.items())
    assert result.ref == VersionRef("r", 2) and result.num_changed_tensors == 1
    with pytest.raises(ConfigError, match="--update-weight-disk-dir"):
        publisher(store, base, run_id="other")
    host = Materializer(tmp_path / "local", base_dir=base)
    assert host.prepare(store).ref == VersionRef("r", 2)
    fresh = publisher(store, base, run_id="other", reset_store=True)
    assert fresh.latest is None and VersionStore(store).latest() is None
    other_v1 = step(base_tensors(), ("model.counts",))
    assert fresh.publish(other_v1.items()).ref == VersionRef("other", 1)
    # the host held run r's v2: it reseeds from the base instead of applying a delta across runs
    prepared = host.prepare(store)
    assert prepared.ref == VersionRef("other", 1) and set(prepared.changed) == set(base_tensors())
    assert_same(held_tensors(tmp_path / "local"), other_v1)


def test_anchors_bound_storage_and_hosts_still_catch_up(tmp_path, base):
    store = tmp_path / "store"
    pub = publisher(store, base, full_anchor_interval=3)
    early = Materializer(tmp_path / "early", base_dir=base)
    current = base_tensors()
    for version in range(1, 8):
        current = step(current, ("model.layers.0.mlp.up_proj.weight",) if version % 2 else ("model.norm.weight",))
        pub.publish(current.items())
        if version == 2:
            early.prepare(store)
    s = VersionStore(store)
    assert s.visible_versions() == [6, 7]
    anchor = read_index(store / "weight_v000006")
    assert anchor.delta_encoding == "full" and set(anchor.weight_map) == set(base_tensors())
    for host_dir in ("early", "late"):
        host = early if host_dir == "early" else Materializer(tmp_path / host_dir, base_dir=base)
        assert host.prepare(store).ref.version == 7
        assert_same(held_tensors(tmp_path / host_dir), current)
