"""ZeRO-Offload / ZeRO-Infinity on this machine: the disk, the swap I/O, the CPU Adam step, step time
with and without offload, and a model whose model states do not fit in memory, trained end to end.

    python benchmarks/offload_bench.py [--parts fio,io,qd,adam,steps,big] [--nvme-path DIR]

- fio: sequential O_DIRECT read and write bandwidth of the disk under ``--nvme-path`` at the swap's
  block size (8 MiB) and queue depth (4, libaio) (``fio``, from apt), the ceiling for the swap;
- io: zeroray's swap files (``zeroray.engine.offload.files``) written and read back through its thread pool,
  O_DIRECT against buffered I/O with ``posix_fadvise(DONTNEED)``, the same bytes as fio;
- qd: the swap and fio at queue depths 1-32 (the measurement behind ``offload_io.queue_depth``);
- aio: the same bytes through DeepSpeed's AsyncIO op (libaio; apt libaio-dev) and io_uring (``pip install liburing``);
- adam: ``torch.optim.AdamW`` (for-loop, foreach, fused) on one 50M-element fp32 shard, one thread,
  against the memory bandwidth of a large copy (an Adam step moves about 28 bytes per element);
- steps: a ~100M-parameter GPT at world 2, stage 3, fp32 AdamW: median step time without offload,
  with CPU offload and with NVMe offload (one run, ratios);
- big: a 1.8B-parameter GPT (bf16 parameters, fp32 AdamW: 16 bytes of model states per parameter,
  ~28.6 GB, more than this machine's 24 GiB) at world 2, stage 3, NVMe offload of the optimizer and
  of the parameters (ZeRO-Infinity):
  loss over a few steps on one repeated batch, peak RSS per rank, step time split into compute and
  I/O wait, bytes moved per step and the disk bandwidth achieved against fio; plus what
  ``zeroray estimate`` says DDP, FSDP2 (= stage 3 without offload) would need.

Results: benchmarks/results/offload.{json,md}. One run; the machine is shared: compare as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zeroray  # noqa: E402
from tests.support.dist import free_port  # noqa: E402
from zeroray.engine.offload.files import AlignedBuffer, SwapDir, wait_all  # noqa: E402
from zeroray.models.gpt import GPT, GPTConfig  # noqa: E402

GB = 1e9
BLOCK = 8 << 20
DEEPSPEED = os.environ.get("OFFLOAD_BENCH_DEEPSPEED", "1") == "1"


def _batch(cfg, spec: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random tokens for zeroray and DeepSpeed: seeded by rank."""
    g = torch.Generator().manual_seed(rank)
    B, T = spec["batch"]
    return (torch.randint(0, cfg.vocab_size, (B, T), generator=g),
            torch.randint(0, cfg.vocab_size, (B, T), generator=g))


# ------------------------------------------------------------------------------ disk

def fio(path: str, size_gb: float, iodepth: int = 4) -> dict[str, float]:
    """fio's sequential O_DIRECT bandwidth (GB/s) at the swap's block size and ``iodepth``."""
    if shutil.which("fio") is None:
        return {"error": "fio not installed (apt-get install fio)"}
    out = {}
    target = os.path.join(path, "fio.dat")
    try:
        for rw in ("write", "read"):
            res = subprocess.run(
                ["fio", "--name=swap", f"--filename={target}", f"--rw={rw}", f"--bs={BLOCK}", "--direct=1",
                 "--ioengine=libaio", f"--iodepth={iodepth}", f"--size={int(size_gb * GB)}", "--output-format=json"],
                capture_output=True, text=True, check=True,
            )
            job = json.loads(res.stdout)["jobs"][0][rw]
            out[f"{rw}_GBps"] = job["bw_bytes"] / GB
    finally:
        if os.path.exists(target):
            os.unlink(target)
    return out


def swap_io(path: str, size_gb: float, direct: bool, queue_depth: int = 4) -> dict[str, float]:
    """Write then read ``size_gb`` through zeroray's swap (files of 256 MB, like sub-groups)."""
    per_file = 256 << 20
    n = max(1, int(size_gb * GB) // per_file)
    swap = SwapDir(path, 0, queue_depth, direct=direct, block_size=BLOCK)
    bufs = [AlignedBuffer(per_file) for _ in range(2)]
    try:
        for b in bufs:
            b.tensor.fill_(1.0)
        t0 = time.perf_counter()
        pending: list = []
        for i in range(n):
            pending += swap.write(f"f{i}", bufs[i % 2], per_file)
        wait_all(pending)
        os.sync()
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        pending = []
        for i in range(n):
            pending += swap.read(f"f{i}", bufs[i % 2], per_file)
        wait_all(pending)
        t_read = time.perf_counter() - t0
        return {"direct": swap.direct, "write_GBps": n * per_file / t_write / GB, "read_GBps": n * per_file / t_read / GB}
    finally:
        swap.close()


def queue_depths(path: str, size_gb: float, depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> dict[str, Any]:
    """zeroray's O_DIRECT swap and fio at each queue depth (threads of the pool; fio's libaio iodepth):
    the measurement behind ``offload_io.queue_depth``'s default."""
    return {str(qd): {"swap": swap_io(path, size_gb, direct=True, queue_depth=qd), "fio": fio(path, size_gb, qd)}
            for qd in depths}


def _timed(write: Any, read: Any, n: int, per_file: int) -> dict[str, float]:
    t0 = time.perf_counter()
    write()
    os.sync()
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    read()
    return {"write_GBps": n * per_file / t_write / GB, "read_GBps": n * per_file / (time.perf_counter() - t0) / GB}


def aio_peers(path: str, size_gb: float, queue_depth: int = 4) -> dict[str, Any]:
    """The same bytes as :func:`swap_io` (256 MB files, 8 MiB requests, O_DIRECT, ``queue_depth`` in
    flight) through the libraries the issue names: DeepSpeed's AsyncIO op (libaio, JIT-built; needs
    libaio-dev) and io_uring (PyPI ``liburing``). Each is reported, or the error that stopped it."""
    per_file = 256 << 20
    n = max(1, int(size_gb * GB) // per_file)
    out: dict[str, Any] = {"zeroray_swap": swap_io(path, size_gb, direct=True, queue_depth=queue_depth)}
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.op_builder import AsyncIOBuilder

        h = AsyncIOBuilder().load().aio_handle(BLOCK, queue_depth, False, True, 1)
        buf = h.new_cpu_locked_tensor(per_file, torch.empty(0, dtype=torch.uint8))
        buf.fill_(1)
        files = [os.path.join(path, f"ds{i}") for i in range(n)]

        def ds(op: str) -> None:
            for f in files:
                getattr(h, op)(buf, f)
            h.wait()

        out["deepspeed_aio"] = _timed(lambda: ds("async_pwrite"), lambda: ds("async_pread"), n, per_file)
        h.free_cpu_locked_tensor(buf)
        for f in files:
            os.unlink(f)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a result
        out["deepspeed_aio"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    try:
        out["io_uring"] = _uring(path, n, per_file, queue_depth)
    except Exception as e:  # noqa: BLE001
        out["io_uring"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    return out


def _uring(path: str, n: int, per_file: int, depth: int) -> dict[str, float]:
    """8 MiB O_DIRECT requests through one io_uring, ``depth`` in flight, from an aligned buffer."""
    import liburing as u

    buf = AlignedBuffer(per_file)
    ring, cqe = u.Ring(), u.Cqe()
    u.io_uring_queue_init(max(depth, 1) * 2, ring)
    fds = [os.open(os.path.join(path, f"ur{i}"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600) for i in range(n)]

    iovs = {off: u.Iovec([buf.view[off : off + BLOCK]]) for off in range(0, per_file, BLOCK)}  # kept alive

    def run(write: bool) -> None:
        reqs = [(fd, off) for fd in fds for off in range(0, per_file, BLOCK)]
        inflight = 0
        while reqs or inflight:
            while reqs and inflight < depth:
                fd, off = reqs.pop(0)
                sqe = u.io_uring_get_sqe(ring)
                (u.io_uring_prep_writev if write else u.io_uring_prep_readv)(sqe, fd, iovs[off], off)
                inflight += 1
            u.io_uring_submit(ring)
            u.io_uring_wait_cqe(ring, cqe)
            if cqe[0].res != BLOCK:
                raise OSError(f"io_uring request returned {cqe[0].res}")
            u.io_uring_cqe_seen(ring, cqe[0])
            inflight -= 1

    try:
        return _timed(lambda: run(True), lambda: run(False), n, per_file)
    finally:
        for i, fd in enumerate(fds):
            os.close(fd)
            os.unlink(os.path.join(path, f"ur{i}"))
        u.io_uring_queue_exit(ring)
        buf.close()


# ------------------------------------------------------------------------------ Adam on the CPU
def adam(numel: int = 50_000_000) -> dict[str, Any]:
    torch.set_num_threads(1)
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)  # pages touched before timing
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    copy_bw = 5 * 2 * 4 * numel / (time.perf_counter() - t0) / GB  # read + write
    out: dict[str, Any] = {"numel": numel, "memory_bandwidth_GBps": copy_bw}
    for variant in ("for-loop", "foreach", "fused"):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        kw = {"foreach": variant == "foreach", "fused": variant == "fused" or None}
        if variant == "for-loop":
            kw = {"foreach": False}
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, **kw)
        except (RuntimeError, ValueError) as e:
            out[variant] = {"error": str(e)}
            continue
        opt.step()  # states made
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        out[variant] = {"step_s": s, "GBps_at_28B_per_param": 28 * numel / s / GB, "of_bandwidth": 28 * numel / s / GB / copy_bw}
        del opt, p
    return out


# ------------------------------------------------------------------------------ training
def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _init(module: torch.nn.Module) -> None:
    """GPT's initialization, and every other module's own (LayerNorm: weight 1, bias 0)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    GPT._init_weights(module)


def _rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(**spec["model"])
        with torch.device("meta"):
            model = GPT(cfg)
        t0 = time.perf_counter()
        engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=spec["lr"]), spec["zero"],
                                    init_fn=_init)
        setup_s = time.perf_counter() - t0
        x, y = _batch(cfg, spec, rank)
        steps = []
        for _ in range(spec["steps"]):
            io0 = engine.offload_io()
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
            t2 = time.perf_counter()
            io1 = engine.offload_io()
            opt, par = io1["optimizer"], io1["params"]
            steps.append({
                "loss": loss.item(), "step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "optimizer_s": t2 - t1,
                **{k: opt[k] - io0["optimizer"].get(k, 0) for k in opt if k != "direct_io"},
                **{f"param_{k}": par[k] - io0["params"].get(k, 0) for k in par},
            })
        mem = engine.memory_report()
        io = engine.optim.io_report()
        engine.close()
        torch.save({"setup_s": setup_s, "steps": steps, "memory": mem, "peak_rss": peak_rss(), "io": io},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def train(spec: dict, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, free_port(), spec, out), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _ds_rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu, gloo) on the same model, its own optimizer block."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(**spec["model"])
        config = {
            "train_micro_batch_size_per_gpu": spec["batch"][0], "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"]}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **spec["ds_zero"]},
            **spec.get("ds_extra", {}),
        }
        t0 = time.perf_counter()
        if spec.get("zero_init"):  # built partitioned (and on NVMe with offload_param), as a big model must be
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        setup_s = time.perf_counter() - t0
        x, y = _batch(cfg, spec, rank)
        steps = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
            steps.append({"loss": loss.item(), "step_s": time.perf_counter() - t0, "optimizer_s": time.perf_counter() - t1})
            print(f"deepspeed rank {rank} step {len(steps)}: {steps[-1]}", flush=True)
        torch.save({"setup_s": setup_s, "steps": steps, "peak_rss": peak_rss()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def deepspeed_peer(spec: dict, world: int = 2, limit_s: float = 900.0) -> list[dict] | dict:
    """The peer's ranks, stopped after ``limit_s`` (its JIT-built ops can take minutes, or hang)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_ds_rank, args=(world, free_port(), spec, out), nprocs=world, join=False)
        deadline = time.monotonic() + limit_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    return {"error": f"did not finish within {limit_s:.0f} s"}
        except Exception as e:  # noqa: BLE001 - the peer's failure is a result to report
            return {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(30)
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def steps_100m(nvme_path: str, steps: int = 6) -> dict[str, Any]:
    model = {"vocab_size": 8192, "block_size": 256, "n_layer": 12, "n_head": 12, "n_embd": 768}  # GPT-2 small shape
    base = {"zero_optimization": {"stage": 3}}
    runs = {
        "none": base,
        "cpu": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        "nvme": {"zero_optimization": {"stage": 3, "sub_group_size": 10_000_000,
                                       "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}}},
    }
    out: dict[str, Any] = {"params": GPTConfig(**model).num_params(), "world": 2, "batch": [2, 128]}
    for name, zero in runs.items():
        res = train({"model": model, "zero": zero, "lr": 1e-4, "batch": [2, 128], "steps": steps})
        def med(key: str, res: list = res) -> float:
            return max(statistics.median(s[key] for s in r["steps"][2:]) for r in res)

        out[name] = {"median_step_s": med("step_s"), "fwd_bwd_s": med("fwd_bwd_s"), "optimizer_s": med("optimizer_s"),
                     "losses": [s["loss"] for s in res[0]["steps"]], "memory": res[0]["memory"], "steps": [r["steps"] for r in res]}
    for name in ("cpu", "nvme"):
        out[name]["vs_none"] = out[name]["median_step_s"] / out["none"]["median_step_s"]
    if DEEPSPEED:
        for name, ds_zero in (("none", {}), ("cpu", {"offload_optimizer": {"device": "cpu"}}),
                              ("nvme", {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}})):
            res = deepspeed_peer({"model": model, "ds_zero": ds_zero, "lr": 1e-4, "batch": [2, 128], "steps": steps})
            if isinstance(res, dict):
                out[f"deepspeed-{name}"] = res
                continue
            out[f"deepspeed-{name}"] = {
                "median_step_s": max(statistics.median(s["step_s"] for s in r["steps"][2:]) for r in res),
                "optimizer_s": max(statistics.median(s["optimizer_s"] for s in r["steps"][2:]) for r in res),
                "losses": [s["loss"] for s in res[0]["steps"]],
            }
            if "median_step_s" in out[name]:
                out[name]["vs_deepspeed"] = out[name]["median_step_s"] / out[f"deepspeed-{name}"]["median_step_s"]
    return out


def big(nvme_path: str, steps: int = 3, queue_depth: int | None = None) -> dict[str, Any]:
    cfg = GPTConfig.for_params(1.75e9)
    model = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    n = cfg.num_params()
    zero = {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "sub_group_size": 30_000_000,
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3},
        "offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}}}
    if queue_depth is not None:
        zero["aio"] = {"queue_depth": queue_depth}
    from zeroray.estimate import estimate

    d = cfg.n_embd
    largest = max(12 * d * d + 13 * d, cfg.vocab_size * d + cfg.block_size * d + 2 * d)  # a block, or the root
    est = {
        f"{name}": {k: v / GB for k, v in estimate(n, world_size=2, stage=stage, precision="bf16", offload=off,
                                                     sub_group_size=30_000_000, buffer_count=3, offload_param=par,
                                                     largest_unit=largest).items() if isinstance(v, (int, float))}
        for name, stage, off, par in (("DDP (stage 0)", 0, "none", "none"), ("FSDP2 / stage 3, no offload", 3, "none", "none"),
                                      ("stage 3 + nvme optimizer", 3, "nvme", "none"),
                                      ("stage 3 + nvme optimizer and parameters", 3, "nvme", "nvme"))
    }
    disk = [fio(nvme_path, 2.0)]  # the disk right before and right after: it swings between runs
    res = train({"model": model, "zero": zero, "lr": 1e-4, "batch": [1, 32], "steps": steps})
    disk.append(fio(nvme_path, 2.0))
    out: dict[str, Any] = {"params": n, "model_states_GB": 16 * n / GB, "estimate_GB_per_rank_world2": est, "ranks": [],
                           "queue_depth": queue_depth or zeroray.ZeroConfig().offload_io.queue_depth, "fio": disk}
    for r in res:
        out["ranks"].append({
            "setup_s": r["setup_s"], "peak_rss_GB": r["peak_rss"] / GB, "memory_report_GB": {k: v / GB for k, v in r["memory"].items()},
            "steps": r["steps"], "direct_io": r["io"].get("direct_io"),
        })
    out["goals"] = io_goals([r["steps"] for r in res], disk)
    return out


def io_goals(per_rank: list[list[dict]], disk: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per step, the issue's two I/O goals: the disk bandwidth the whole step achieved, as a fraction of
    fio's (every rank's swap bytes at fio's read and write rates, mean of the runs around, over the step
    time; goal >= 0.85), and the step time over max(I/O time at fio's rates, the time no rank waited
    for I/O) (goal <= 1.15)."""
    if any("error" in d for d in disk):
        return []
    read_bw = statistics.mean(d["read_GBps"] for d in disk) * GB
    write_bw = statistics.mean(d["write_GBps"] for d in disk) * GB
    out = []
    for steps in zip(*per_rank):
        reads = sum(s["bytes_read"] + s.get("param_bytes_read", 0) for s in steps)
        writes = sum(s["bytes_written"] + s.get("param_bytes_written", 0) for s in steps)
        step = max(s["step_s"] for s in steps)
        io = reads / read_bw + writes / write_bw
        compute = max(s["step_s"] - s["read_wait_s"] - s["write_wait_s"] - s.get("param_read_wait_s", 0) for s in steps)
        out.append({"step_s": step, "GB_read": reads / GB, "GB_written": writes / GB, "io_at_fio_s": io,
                    "compute_s": compute, "of_fio": io / step, "step_over_max": step / max(io, compute)})
    return out


def big_deepspeed(nvme_path: str, steps: int = 3, limit_s: float = 2400.0) -> dict[str, Any]:
    """DeepSpeed ZeRO-Infinity on :func:`big`'s model: stage 3, bf16, optimizer states and parameters on
    NVMe, the model built under ``deepspeed.zero.Init``. Run the benchmark in a memory cgroup: a peer
    that does not fit must be killed, not take the machine down."""
    cfg = GPTConfig.for_params(1.75e9)
    model = {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    ds_zero = {"sub_group_size": 30_000_000,
               "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3},
               "offload_param": {"device": "nvme", "nvme_path": nvme_path}}
    res = deepspeed_peer({"model": model, "ds_zero": ds_zero, "ds_extra": {"bf16": {"enabled": True}}, "zero_init": True,
                          "lr": 1e-4, "batch": [1, 32], "steps": steps}, limit_s=limit_s)
    if isinstance(res, dict):
        return res
    return {"ranks": [{"setup_s": r["setup_s"], "peak_rss_GB": r["peak_rss"] / GB, "steps": r["steps"]} for r in res]}


def _ds_rank_line(r: int, rk: dict) -> str:
    times = ", ".join(f"{s['step_s']:.1f}" for s in rk["steps"])
    losses = ", ".join(f"{s['loss']:.4f}" for s in rk["steps"])
    return f"rank {r} steps {times} s, losses {losses}, peak RSS {rk['peak_rss_GB']:.2f} GB"


def markdown(res: dict) -> str:
    lines = ["# Offload benchmark", "", "One run on the project machine (2 cores, 24 GiB, one virtual disk), world 2, gloo.", ""]
    if "fio" in res:
        lines += ["## Disk and swap I/O", "", "| | write GB/s | read GB/s |", "|---|---|---|"]
        f = res["fio"]
        lines.append(f"| fio, O_DIRECT, 8 MiB blocks, libaio queue depth 4 | {f.get('write_GBps', 0):.2f} | {f.get('read_GBps', 0):.2f} |")
        for k in ("io_direct", "io_buffered"):
            if k in res:
                r = res[k]
                lines.append(f"| zeroray swap, {'O_DIRECT' if r['direct'] else 'buffered + DONTNEED'} | {r['write_GBps']:.2f} | {r['read_GBps']:.2f} |")
        lines.append("")
    if "qd" in res:
        lines += ["## Queue depth (O_DIRECT, 8 MiB requests)", "",
                  "| queue depth | swap write GB/s | swap read GB/s | fio write GB/s | fio read GB/s |", "|---|---|---|---|---|"]
        for qd, r in res["qd"].items():
            lines.append(f"| {qd} | {r['swap']['write_GBps']:.2f} | {r['swap']['read_GBps']:.2f} | "
                         f"{r['fio'].get('write_GBps', 0):.2f} | {r['fio'].get('read_GBps', 0):.2f} |")
        lines.append("")
    if "aio" in res:
        lines += ["## Async I/O libraries against zeroray's thread pool (O_DIRECT, 8 MiB requests, 4 in flight)", "",
                  "| | write GB/s | read GB/s |", "|---|---|---|"]
        for k, r in res["aio"].items():
            cells = f"{r['write_GBps']:.2f} | {r['read_GBps']:.2f}" if "write_GBps" in r else f"{r['error'][:120]} |"
            lines.append(f"| {k} | {cells} |")
        lines.append("")
    if "adam" in res:
        a = res["adam"]
        lines += ["## AdamW on one CPU thread (50M fp32 elements)", "",
                  f"Memory bandwidth (copy): {a['memory_bandwidth_GBps']:.1f} GB/s.", "",
                  "| variant | step s | GB/s at 28 B/param | of bandwidth |", "|---|---|---|---|"]
        for v in ("for-loop", "foreach", "fused"):
            r = a[v]
            lines.append(f"| {v} | {r['step_s']:.3f} | {r['GBps_at_28B_per_param']:.1f} | {r['of_bandwidth']:.0%} |" if "step_s" in r else f"| {v} | {r['error']} | | |")
        lines.append("")
    if "steps" in res:
        s = res["steps"]
        lines += [f"## Step time, {s['params'] / 1e6:.0f}M-parameter GPT, stage 3, world 2, fp32 AdamW, batch 2x128", "",
                  "| offload | zeroray median step s | fwd+bwd s | optimizer s | ÷ zeroray none | DeepSpeed step s | ÷ DeepSpeed |",
                  "|---|---|---|---|---|---|---|"]
        for k in ("none", "cpu", "nvme"):
            ds = s.get(f"deepspeed-{k}", {})
            ds_cell = f"{ds['median_step_s']:.2f}" if "median_step_s" in ds else ds.get("error", "not run")[-120:]
            ratio = f"{s[k]['vs_deepspeed']:.2f}" if "vs_deepspeed" in s[k] else "-"
            lines.append(f"| {k} | {s[k]['median_step_s']:.2f} | {s[k].get('fwd_bwd_s', float('nan')):.2f} | {s[k]['optimizer_s']:.2f} | "
                         f"{s[k].get('vs_none', 1.0):.2f} | {ds_cell} | {ratio} |")
        lines.append("")
    if "big" in res:
        b = res["big"]
        lines += [f"## {b['params'] / 1e9:.2f}B-parameter GPT, stage 3 + NVMe offload of optimizer and parameters, world 2, bf16, "
                  "batch 1x32", "",
                  f"Model states: {b['model_states_GB']:.1f} GB (16 B/param), more than the machine's 24 GiB (25.8 GB).", "",
                  "`zeroray estimate` per rank at world 2 (GB on the device / offloaded):", ""]
        for k, v in b["estimate_GB_per_rank_world2"].items():
            lines.append(f"- {k}: {v['total']:.1f} / {v['offloaded']:.1f}")
        lines += ["", "| rank | step | loss | step s | fwd+bwd s | optimizer s | read wait s | write wait s | GB read | GB written "
                  "| param read wait s | param GB read | param GB written | gathers read ahead / on demand |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, rk in enumerate(b["ranks"]):
            for i, st in enumerate(rk["steps"]):
                lines.append(f"| {r} | {i} | {st['loss']:.4f} | {st['step_s']:.1f} | {st['fwd_bwd_s']:.1f} | {st['optimizer_s']:.1f} | "
                             f"{st['read_wait_s']:.1f} | {st['write_wait_s']:.1f} | {st['bytes_read'] / GB:.1f} | {st['bytes_written'] / GB:.1f} | "
                             f"{st.get('param_read_wait_s', 0):.1f} | {st.get('param_bytes_read', 0) / GB:.2f} | "
                             f"{st.get('param_bytes_written', 0) / GB:.2f} | "
                             f"{st.get('param_reads_ahead_used', 0):.0f} / {st.get('param_reads_on_demand', 0):.0f} |")
        lines.append("")
        if b.get("goals"):
            fio_runs = ", ".join(f"{d['write_GBps']:.2f} / {d['read_GBps']:.2f}" for d in b["fio"])
            lines += ["", f"The issue's I/O goals, both ranks together (fio write / read GB/s around the run: {fio_runs}):", "",
                      "| step | step s | GB read | GB written | I/O time at fio's rates s | compute s (no rank waiting) "
                      "| of fio's bandwidth (goal >= 0.85) | step / max(I/O, compute) (goal <= 1.15) |",
                      "|---|---|---|---|---|---|---|---|"]
            for i, g in enumerate(b["goals"]):
                lines.append(f"| {i} | {g['step_s']:.1f} | {g['GB_read']:.1f} | {g['GB_written']:.1f} | {g['io_at_fio_s']:.1f} | "
                             f"{g['compute_s']:.1f} | {g['of_fio']:.2f} | {g['step_over_max']:.2f} |")
            lines.append("")
        ds = res.get("deepspeed_big")
        if ds is not None:
            lines += ["", "DeepSpeed ZeRO-Infinity on the same model (optimizer states and parameters on NVMe, built under "
                      "`zero.Init`): " + (ds["error"] if "error" in ds else "; ".join(_ds_rank_line(r, rk) for r, rk in enumerate(ds["ranks"]))),
                      ""]
        for r, rk in enumerate(b["ranks"]):
            lines.append(f"- rank {r}: peak RSS {rk['peak_rss_GB']:.2f} GB, set-up {rk['setup_s']:.0f} s, O_DIRECT {bool(rk['direct_io'])}, "
                         f"memory_report host {rk['memory_report_GB']['host']:.2f} GB, nvme {rk['memory_report_GB']['nvme']:.1f} GB")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="fio,io,adam,steps,big")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--io-gb", type=float, default=4.0)
    ap.add_argument("--queue-depth", type=int, default=None, help="big: offload_io.queue_depth (default: zeroray's)")
    ap.add_argument("--out", default=str(HERE / "results" / "offload"))
    args = ap.parse_args()
    parts = args.parts.split(",")
    path = tempfile.mkdtemp(prefix="zeroray-offload-bench-", dir=args.nvme_path)
    res: dict[str, Any] = {}
    if os.path.exists(args.out + ".json"):
        res = json.loads(Path(args.out + ".json").read_text())
    try:
        if "fio" in parts:
            res["fio"] = fio(path, args.io_gb)
        if "io" in parts:
            res["io_direct"] = swap_io(path, args.io_gb, direct=True)
            res["io_buffered"] = swap_io(path, args.io_gb, direct=False)
        if "qd" in parts:
            res["qd"] = queue_depths(path, args.io_gb)
        if "aio" in parts:
            res["aio"] = aio_peers(path, args.io_gb)
        if "adam" in parts:
            res["adam"] = adam()
        if "steps" in parts:
            res["steps"] = steps_100m(path)
        if "big" in parts:
            res["big"] = big(path, queue_depth=args.queue_depth)
        if "dsbig" in parts:
            res["deepspeed_big"] = big_deepspeed(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    Path(args.out + ".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
