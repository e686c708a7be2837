"""Checkpoints with NVMe offload: the states stream from and to the swap files.

A save reads each section of the rank file out of the swap files through the swap pool's buffers;
a load fills one sub-group's buffer from the checkpoint's byte ranges and writes its file once.
Neither holds the whole fp32 master and optimizer states in host memory, and the file a save
writes is, byte for byte, the one the same run writes without offload.

Real processes (gloo), real swap files, peak RSS read from /proc in a fresh process.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import zeroray
import zeroray.checkpoint as ckpt
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.offload import run_rss_probe
from tests.support.recipe import CLIP, GAS, optimizer, train
from zeroray.checkpoint.manifest import Manifest
from zeroray.checkpoint.storage import open_url, read_manifest


def _save_worker(rank: int, world: int, path: str, urls: dict[str, str], offload: dict | None) -> None:
    """Train a few steps, then save synchronously and through an AsyncSaver, whose upload runs while
    training goes on (the steps rewrite the swap files meanwhile); train on and save again."""
    torch.manual_seed(0)
    model = TinyLM()
    cfg = zeroray.ZeroConfig(
        stage=3, gradient_accumulation_steps=GAS, gradient_clipping=CLIP, comm={"reduce_bucket_size": 500},
        **(offload or {}),
    )
    engine = zeroray.initialize(model, optimizer(model), cfg)
    saver = ckpt.AsyncSaver(engine)
    data = batches(rank, 4 * GAS)
    for step, name in ((0, "first"), (1, "second")):
        train(engine, data[2 * GAS * step : 2 * GAS * (step + 1)])
        ckpt.save(engine, urls[name])
        saver.save(urls[name + "-async"])
    saver.wait()
    if offload:  # the copy of the swap files an async save streamed from is gone once it is done
        assert [f for f in os.listdir(engine.optim.home.swap.path) if not f.startswith("subgroup")] == []
    engine.close()


def _shard_bytes(url: str) -> tuple[Manifest, dict[tuple, bytes]]:
    fs, path = open_url(url)
    manifest = read_manifest(fs, path, url)
    out = {}
    for f, s in manifest.sections("shard"):
        with open(os.path.join(path, f.path), "rb") as fh:
            fh.seek(s.offset)
            out[(f.rank, s.group, s.key, s.shard)] = fh.read(s.nbytes)
    return manifest, out


def test_nvme_checkpoint_is_byte_identical_to_the_same_run_without_offload(tmp_path):
    """Same seed, same data: the run with its states in swap files (several sub-groups per flat
    group, groups split across sub-groups, a pool of one buffer or three) saves the same shard
    sections, at the same offsets, with the same checksums, as the run without offload."""
    runs = {
        "plain": None,
        "nvme": {"sub_group_size": 70, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}},
        "nvme-1buf": {"sub_group_size": 45, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 1}},
    }
    urls = {}
    for run, offload in runs.items():
        urls[run] = {n: str(tmp_path / run / n) for n in ("first", "first-async", "second", "second-async")}
        run_ranks(_save_worker, 2, str(tmp_path), urls[run], offload)
    for name in ("first", "first-async", "second", "second-async"):
        ref_manifest, ref = _shard_bytes(urls["plain"][name])
        assert any(k[2] == "exp_avg_sq" for k in ref) and len(ref) > 6
        for run in ("nvme", "nvme-1buf"):
            manifest, got = _shard_bytes(urls[run][name])
            assert manifest.groups == ref_manifest.groups, (run, name)
            assert got.keys() == ref.keys(), (run, name)
            for k in ref:
                assert got[k] == ref[k], (run, name, k)
            for f, g in zip(manifest.files, ref_manifest.files, strict=True):
                assert f.sections == g.sections and f.chunks == g.chunks and f.size == g.size, (run, name, f.path)
    for run in runs:  # an async save holds the state of its call, whatever the steps after it did
        for name in ("first", "second"):
            assert _shard_bytes(urls[run][name + "-async"])[1] == _shard_bytes(urls[run][name])[1], (run, name)
    assert os.listdir(tmp_path / "zeroray-swap") == []


_RSS = """
import json, sys, time, torch, zeroray
import zeroray.checkpoint as ckpt
torch.set_num_threads(1)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def peak_growth(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = rss("VmRSS")
    t0 = time.perf_counter()
    fn()
    return rss("VmHWM") - before, time.perf_counter() - t0

nvme_path, url, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(
    stage=1, sub_group_size=1 << 20, offload_optimizer={"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}))
x = torch.randn(8, 1024)
engine.backward(model(x).square().mean())
engine.step()
want = engine.full_state_dict()
saver = ckpt.AsyncSaver(engine)

def save_async():
    saver.save(url + "-async")
    saver.wait()

out = {"memory": engine.memory_report()}
out["save"] = peak_growth(lambda: ckpt.save(engine, url))
out["async_save"] = peak_growth(save_async)
out["load"] = peak_growth(lambda: ckpt.load(engine, url))
got = engine.full_state_dict()
out["same"] = all(torch.equal(got[k], want[k]) for k in want)
engine.close()
print(json.dumps(out))
"""


def run_rss(nvme_path: str, url: str, layers: int = 24) -> dict:
    """Peak RSS growth (bytes) and seconds of a save, an AsyncSaver save and a load of a
    ``layers`` x 1M-parameter model, NVMe-offloaded with a pool of 3 x (master + 2 moments) x 4 MiB,
    in a fresh process."""
    return run_rss_probe(_RSS, nvme_path, url, str(layers))


def test_nvme_save_and_load_peak_rss_is_bounded_by_the_pool_not_the_states(tmp_path):
    """25.2M parameters: 302 MB of fp32 masters and Adam moments in swap files, a pool of 36 MB
    (3 buffers of 12 MB, already resident after the first step). A save streams each section
    through the pool's buffers and a load fills them sub-group by sub-group, so neither grows the
    process by more than the pool plus its working set, far below the states. The working set is
    the checkpoint reader's: the 4 MiB checksum chunks a sub-group's ranges only partly cover are
    read into scratch, at most 2 per range read and 4 range reads in flight (32 MiB). Measured
    here (mmap threshold fixed): save +0.3 MB, AsyncSaver save +4 MB (its copy of the swap files is
    read back through a buffer of its own), load +13 MB. Before streaming, a save read every
    swap file into fresh tensors (+319 MB) and a load read the whole checkpoint into memory
    (+315 MB)."""
    (tmp_path / "swap").mkdir()
    res = run_rss(str(tmp_path / "swap"), str(tmp_path / "ckpt"))
    states, pool = res["memory"]["nvme"], res["memory"]["host"]
    assert states > 300e6 and pool == 3 * 3 * (1 << 22)
    assert res["same"]
    bound = pool + 4 * 2 * (4 << 20)  # 70 MB, against 302 MB of states
    for what in ("save", "async_save", "load"):
        assert res[what][0] < bound, (what, res)


def test_async_save_without_room_for_a_copy_streams_before_it_returns(tmp_path):
    """An AsyncSaver copies the swap files on their disk; where the disk has no room for the copy
    (a 32 MB tmpfs: less than the 64 MiB it keeps free), it streams the rank file from the swap
    files before it returns, and the checkpoint is still the state of the call."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        torch.manual_seed(0)
        model = TinyLM()
        cfg = zeroray.ZeroConfig(stage=1, sub_group_size=50, offload_optimizer={"device": "nvme", "nvme_path": str(mnt)})
        engine = zeroray.initialize(model, optimizer(model), cfg)
        try:
            data = batches(0, 4)
            train(engine, data[:2])
            ckpt.save(engine, str(tmp_path / "sync"))
            saver = ckpt.AsyncSaver(engine)
            saver.save(str(tmp_path / "async"))
            files = sorted(os.listdir(engine.optim.home.swap.path))
            assert files == [f"subgroup{i:05d}.swap" for i in range(len(engine.optim.sub_groups))]  # no copy
            train(engine, data[2:])
            saver.wait()
        finally:
            engine.close()
        assert _shard_bytes(str(tmp_path / "async"))[1] == _shard_bytes(str(tmp_path / "sync"))[1]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_nvme_load_writes_each_swap_file_once_and_reads_none(tmp_path):
    """A load into an NVMe-offloaded engine fills each sub-group's buffer from the checkpoint and
    writes its file once: swap bytes written = the files' size, swap bytes read = 0 (before, each
    piece read and rewrote its sub-group's whole file). The same for state handed over in memory
    (``load_shard_state``: in-memory snapshots, pretrained weights)."""
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, optimizer(model), zeroray.ZeroConfig(stage=1))
    train(engine, batches(0, 2))
    url = str(tmp_path / "ckpt")
    ckpt.save(engine, url)
    want = {g.name: {k: v.clone() for k, v in g.tensors.items()} for g in engine.shard_state()}
    meta = engine.state_meta()
    engine.close()

    torch.manual_seed(1)
    model = TinyLM()
    cfg = zeroray.ZeroConfig(stage=1, sub_group_size=45, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    nvme = zeroray.initialize(model, optimizer(model), cfg)
    assert max(len(s.pieces) for s in nvme.optim.sub_groups) > 1
    for load in (lambda: ckpt.load(nvme, url), lambda: nvme.load_shard_state(want, meta)):
        before = nvme.optim.io_report()
        load()
        after = nvme.optim.io_report()
        assert after["bytes_read"] == before["bytes_read"]
        assert after["bytes_written"] - before["bytes_written"] == nvme.memory_report()["nvme"]
        got = {g.name: g.tensors for g in nvme.shard_state()}
        for name, tensors in want.items():
            assert got[name].keys() == tensors.keys()
            for k, v in tensors.items():
                assert torch.equal(got[name][k], v), (name, k)
    nvme.close()
