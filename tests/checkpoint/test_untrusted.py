"""A checkpoint from elsewhere runs none of its code when loaded, reads nothing outside its directory, and any
damage is a CheckpointError: crafted pickles and random bytes in every kind of file (plain, sharded, DeepSpeed),
with and without a manifest fixed up to match them."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from torch import nn

from fabric_lite import Accelerator
from fabric_lite.checkpoint import checksums
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.checkpoint.state import export_weights


class _Payload:
    """Unpickling this writes `path`: what an attacker's pickle does."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


def crafted_pickle(marker) -> bytes:
    return pickle.dumps({"model_0.weight": _Payload(marker)}, protocol=2)


def crafted_torch_file(marker) -> bytes:
    """A torch.save zip whose data.pkl runs code (what weights_only=False would unpickle)."""
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(2), "x": _Payload(marker)}, buf)
    return buf.getvalue()


def fix_manifest(directory, name):
    """Put the checksum of the file as it is now into the manifest (what an attacker would do)."""
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    expected = manifest["files"][name]
    full = os.path.join(directory, name)
    manifest["files"][name] = checksums.checksum_of(full, expected, manifest.get("checksum", "sha256"))
    with open(path, "w") as f:
        json.dump(manifest, f)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _train_and_save(path, strategy=None):
    acc = Accelerator(cpu=True, **({"strategy": strategy} if strategy else {}))
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        acc.backward(model(torch.randn(5, 4)).pow(2).sum())
        opt.step()
        opt.zero_grad()
    acc.save_state(str(path))
    acc.end_training()  # (the sharded run's process group must not outlive this test)


def _fresh():
    acc = Accelerator(cpu=True)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.optimizer.state.values())})


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and \
        all(torch.equal(x, y) for x, y in zip(a[1].values(), b[1].values()))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A plain and a sharded (DCP) checkpoint of the same run, and what loading each cleanly gives."""
    root = tmp_path_factory.mktemp("clean")
    _train_and_save(root / "plain")
    _train_and_save(root / "sharded", strategy="fsdp")
    loaded = {}
    for kind in ("plain", "sharded"):
        acc, model, opt = _fresh()
        acc.load_state(str(root / kind))
        loaded[kind] = _snapshot(model, opt)
    return root, loaded


def _copy(clean, kind, tmp_path):
    target = tmp_path / kind
    shutil.copytree(clean[0] / kind, target)
    return target


# -- code runs on load -------------------------------------------------------------------------------------

def test_crafted_dcp_index_with_a_fixed_manifest_runs_nothing_in_load_state_or_consolidate(clean, tmp_path):
    ckpt = _copy(clean, "sharded", tmp_path)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    fix_manifest(ckpt, ".metadata")
    acc, model, opt = _fresh()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"\.metadata is not a DCP index this can read safely"):
        acc.load_state(str(ckpt))
    assert not marker.exists()
    assert _equal(before, _snapshot(model, opt))
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        export_weights(str(ckpt), str(tmp_path / "w.pt"))
    done = subprocess.run([sys.executable, "-m", "fabric_lite.cli", "consolidate", str(ckpt), str(tmp_path / "w.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not marker.exists()
    assert ".metadata" in done.stderr and "Traceback" not in done.stderr


def _shard_files(ckpt):
    return {n for n in os.listdir(ckpt) if n.endswith(".distcp")}


def _index(ckpt):
    """A sharded checkpoint's DCP index, read the safe way (what a crafted one is made from)."""
    from fabric_lite.checkpoint import dcp_reading

    return dcp_reading.read_metadata((ckpt / ".metadata").read_bytes(), _shard_files(ckpt), str(ckpt))


def test_dcp_index_pointing_outside_the_checkpoint_is_refused(clean, tmp_path):
    """A well-formed index whose storage entry names another file: DCP would read it; it is refused."""
    ckpt = _copy(clean, "sharded", tmp_path)
    metadata = _index(ckpt)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    fix_manifest(ckpt, ".metadata")
    acc, model, opt = _fresh()
    with pytest.raises(CheckpointError, match="not one of this checkpoint's shard files"):
        acc.load_state(str(ckpt))


def test_crafted_dcp_value_runs_nothing(clean, tmp_path):
    """DCP's default planner unpickles values that are not tensors in full; here they load weights_only."""
    import torch.distributed.checkpoint as dcp

    ckpt = _copy(clean, "sharded", tmp_path)
    marker = tmp_path / "ran"
    # the attacker's shards: the same keys, one optimizer value replaced by a payload
    shards = _shard_files(ckpt)
    metadata = _index(ckpt)
    state = {}
    for key, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "size"):
            state[key] = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        else:
            state[key] = _Payload(marker)
    assert any(isinstance(v, _Payload) for v in state.values()), "the checkpoint holds values that are not tensors"
    for name in shards | {".metadata"}:
        (ckpt / name).unlink()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    assert not marker.exists()  # (saving pickles it; only unpickling runs it)
    with open(ckpt / "manifest.json") as f:
        manifest = json.load(f)
    manifest["files"] = {n: v for n, v in manifest["files"].items() if not n.endswith((".distcp", ".metadata"))}
    for name in os.listdir(ckpt):
        if name.endswith(".distcp") or name == ".metadata":
            manifest["files"][name] = checksums.digest_file(str(ckpt / name), manifest["checksum"])
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    acc, model, opt = _fresh()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError):
        acc.load_state(str(ckpt))
    assert not marker.exists()
    assert _equal(before, _snapshot(model, opt))


@pytest.mark.parametrize("algorithm", ["sha256", "md5"])
def test_the_manifest_naming_another_algorithm_does_not_skip_the_shard_checks(clean, tmp_path, algorithm):
    ckpt = _copy(clean, "sharded", tmp_path)
    shard = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    data = bytearray((ckpt / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / shard).write_bytes(bytes(data))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["checksum"] = algorithm
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    acc, model, opt = _fresh()
    with pytest.raises(CheckpointError, match="corrupt|md5"):
        acc.load_state(str(ckpt))


def test_weights_only_false_verifies_before_unpickling(clean, tmp_path):
    ckpt = _copy(clean, "plain", tmp_path)
    marker = tmp_path / "ran"
    (ckpt / "training_state.pt").write_bytes(crafted_torch_file(marker))  # the manifest is NOT fixed up
    acc, model, opt = _fresh()
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        acc.load_state(str(ckpt), weights_only=False)
    assert not marker.exists()


@pytest.mark.parametrize("kind,member", [("plain", "model_0.pt"), ("plain", "manifest.json"), ("plain", "rng_0.pt"),
                                         ("sharded", "__0_0.distcp"), ("sharded", ".metadata")])
def test_a_member_linked_outside_the_checkpoint_is_refused(clean, tmp_path, kind, member):
    ckpt = _copy(clean, kind, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(ckpt / member), outside / member)  # the same bytes: its checksum matches
    os.symlink(outside / member, ckpt / member)
    acc, model, opt = _fresh()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        acc.load_state(str(ckpt))
    assert _equal(before, _snapshot(model, opt))


def test_a_link_inside_the_checkpoint_and_a_linked_checkpoint_directory_load(clean, tmp_path):
    ckpt = _copy(clean, "plain", tmp_path)
    os.rename(ckpt / "model_0.pt", ckpt / "weights.bin")
    os.symlink("weights.bin", ckpt / "model_0.pt")
    os.symlink(ckpt, tmp_path / "alias")
    acc, model, opt = _fresh()
    acc.load_state(str(tmp_path / "alias"))
    assert _equal(_snapshot(model, opt), clean[1]["plain"])


# -- the fuzz test -------------------------------------------------------------------------------------------

def _mutations(rng, marker):
    def random_bytes(data):
        return bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 17, 300, len(data)])))

    def flip(data):
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            if out:
                out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)

    def truncate(data):
        return data[: rng.randrange(max(1, len(data)))]

    def pickled(data):
        return crafted_pickle(marker)

    def torch_file(data):
        return crafted_torch_file(marker)

    def zip_with_crafted_pickle(data):
        """The file's own zip with its data.pkl replaced by a payload (the tensors' records kept)."""
        try:
            source = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            return crafted_pickle(marker)
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
            for info in source.infolist():
                body = crafted_pickle(marker) if info.filename.endswith("data.pkl") else source.read(info)
                target.writestr(info.filename, body)
        return out.getvalue()

    def wrong_structure(data):
        buf = io.BytesIO()
        torch.save(rng.choice([[1, 2], {"x": torch.ones(2)}, "text", {"rng": 3, "optimizers": {}}]), buf)
        return buf.getvalue()

    return [random_bytes, flip, truncate, pickled, torch_file, zip_with_crafted_pickle, wrong_structure]


def _load_outcome(kind, ckpt, tmp_path):
    """'error' or the loaded snapshot; any exception other than CheckpointError fails the test."""
    acc, model, opt = _fresh()
    try:
        if kind == "deepspeed":
            export_weights(str(ckpt), str(tmp_path / "w.pt"))
        else:
            acc.load_state(str(ckpt))
    except CheckpointError:
        return "error"
    return _snapshot(model, opt)


def _deepspeed_like(root):
    """A checkpoint in the DeepSpeed layout (what `consolidate` reads without an engine): its files are fuzzed."""
    ckpt = root / "deepspeed"
    shutil.copytree(root / "plain", ckpt)
    weights = torch.load(ckpt / "model_0.pt", weights_only=True)
    buf = io.BytesIO()
    torch.save({"module": weights, "buffer_names": [], "ds_version": "0.19"}, buf)
    (ckpt / "deepspeed_mp_rank_00_model_states.pt").write_bytes(buf.getvalue())
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["meta"]["engine"] = "deepspeed"
    manifest["files"]["deepspeed_mp_rank_00_model_states.pt"] = checksums.digest_file(
        str(ckpt / "deepspeed_mp_rank_00_model_states.pt"), manifest["checksum"])
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def test_fuzzed_checkpoints_run_no_code_and_load_cleanly_or_raise_checkpoint_error(clean, tmp_path):
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "28")))
    pytest.importorskip("deepspeed")
    marker = tmp_path / "ran"
    root = tmp_path / "src"
    shutil.copytree(clean[0], root)
    _deepspeed_like(root)
    tried = 0
    for kind in ("plain", "sharded", "deepspeed"):
        names = sorted(json.loads((root / kind / "manifest.json").read_text())["files"]) + ["manifest.json"]
        if kind == "deepspeed":
            names = ["deepspeed_mp_rank_00_model_states.pt", "manifest.json"]
        for name in names:
            for mutate in _mutations(rng, marker):
                for fixed in (False, True):
                    if name == "manifest.json" and fixed:
                        continue
                    case = tmp_path / f"case{tried}"
                    shutil.copytree(root / kind, case)
                    original = (case / name).read_bytes()
                    (case / name).write_bytes(mutate(original))
                    if fixed:
                        fix_manifest(case, name)
                    outcome = _load_outcome(kind, case, tmp_path)
                    assert not marker.exists(), f"code ran: {kind}/{name} {mutate.__name__} fixed={fixed}"
                    if outcome != "error" and kind != "deepspeed":
                        assert _equal(outcome, clean[1][kind]), \
                            f"{kind}/{name} {mutate.__name__} fixed={fixed} loaded other values without an error"
                    shutil.rmtree(case)
                    tried += 1
    assert tried > 80
