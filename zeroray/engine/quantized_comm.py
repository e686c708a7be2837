"""ZeRO++'s quantized collectives (Wang et al., 2023): qwZ's weight gather and qgZ's gradient reduce-scatter.

- **qwZ** (:class:`QuantizedGather`): stage 3's all-gathers of a step, the forward's and the backward's, move
  int8 codes with one fp32 scale per block instead of the compute-dtype weights; every rank, the sender
  included, dequantizes every shard on arrival, so all ranks compute with the same weights. The codes are a
  fixed function of the shard, so the backward computes with the very weights its forward used (as under
  DeepSpeed's ``zero_quantized_weights``, and as hpZ's secondary copy, which holds the forward's values); with
  ``exact_backward`` the backward gathers the full-precision weights instead, and its gradients then belong to
  weights other than those of the forward that made the activations (the convergence study measured that form
  lagging: benchmarks/results/zeropp/convergence.md). The master and the sharded states stay full precision.
  With ``draws`` the codes are rounded stochastically (zeroray.engine.rounding), the forward's and the
  backward's from the same draws, so the backward still computes with the forward's weights.
- **qgZ** (:class:`QuantizedReduceScatter`): the gradient reduce-scatter becomes an all-to-all of quantized
  rows: row r of each rank's gradient buffer goes to rank r, which dequantizes the rows it received and sums
  them in fp32. When the shard group spans nodes with the same number m of ranks on each, in node-major
  order, it is hierarchical, as in ZeRO++: an all-to-all inside the node first (each rank gets, from its m
  node peers, the rows of the ranks at its own place on every node), a dequantize-and-sum in fp32, a
  requantize, then an all-to-all across nodes among the ranks at the same place. Only 1/m of the gradient
  crosses the node's link per rank, quantized. With ``quantize_node=False`` the stage inside the node moves
  the full-precision rows instead, and only the node's fp32 sum is quantized, once, before it crosses: a
  third of the quantize and dequantize work and one rounding instead of two, for 4x (fp32) the bytes on
  the node's own links, which is the better trade where those are fast and the cores are few. With
  ``draws`` every quantization of it is rounded stochastically.

With ``codes="fp8"`` qgZ's rows are float8 e4m3 codes with the block's scale instead of integers: the same
bytes as int8, and an error relative to each element (at most 1/16) instead of to its block's largest, so the
many small gradients of a block keep their size; Adam divides each element's step by its own gradient's
size, and int8's error on the small ones measured as a lag in the convergence study.

Byte counts (``comm_report``), B = ``BlockQuantizer.row_bytes``, S the shard's elements, N the group size:
qwZ counts ``all_gather_int8`` = N x B(S) a gather; qgZ counts ``all_to_all_int<bits>`` (``all_to_all_fp8``) = N x B(S) in one level, or
N x B(S) inside the node plus (N/m) x B(S) across nodes when hierarchical (scales included); with
``quantize_node=False`` the node's stage counts ``all_to_all`` = N x S x 4 (fp32) instead.
"""

from __future__ import annotations

from typing import Literal

import torch

from zeroray.engine.comm import Chain, Comm, Handle
from zeroray.engine.quantize import BlockQuantizer, QuantizeKernels
from zeroray.engine.rounding import Draws

WEIGHT_BITS = 8
Phase = Literal["forward", "backward"]  # which of a step's gathers (None: an exact gather, outside the step)


class QuantizedGather:
    """qwZ: a block-wise int8 all-gather of a flat group's shards into its full buffer."""

    def __init__(self, block: int, compiled: bool = False, exact_backward: bool = False, draws: Draws | None = None):
        self.quantizer = QuantizeKernels(BlockQuantizer(WEIGHT_BITS, block), compiled)
        self.kind = f"all_gather_int{WEIGHT_BITS}"
        self.exact_backward = exact_backward
        self.draws = draws  # stochastic rounding; None: to nearest

    def quantizes(self, phase: Phase | None) -> bool:
        """Whether a gather for ``phase`` goes through this quantized gather (else full precision)."""
        return phase == "forward" or (phase == "backward" and not self.exact_backward)

    def all_gather(self, comm: Comm, full: torch.Tensor, shard: torch.Tensor, key: str) -> Handle:
        """Issue the gather of every rank's ``shard`` into ``full`` (``world x shard`` elements, compute dtype);
        the values land, dequantized, when the handle is waited. ``key``: the flat group's name (the draws')."""
        q, world, s = self.quantizer, comm.world_size, shard.numel()
        send = _quantize(q, shard.view(1, s), self.draws, f"{comm.rank}/{key}")
        recv = q.empty((world, send.shape[1]), torch.uint8, send.device)
        handle = comm.all_gather(recv.view(-1), send.view(-1), async_op=True, kind=self.kind)

        def land() -> None:
            q.dequantize(recv, s, out=full.view(world, s))
            q.release(send, recv)

        return handle.then(land)


class QuantizedReduceScatter:
    """qgZ: the sum over ``comm``'s ranks of a flat gradient buffer, this rank's shard of it, through quantized
    all-to-alls. ``node`` and ``cross`` (both or neither): the ranks of this rank's node among ``comm``'s
    (its rank there = its place in the node) and the ranks at its place on every node (its rank there = its
    node's index), for the hierarchical form; ``comm``'s ranks must then be node-major. ``quantize_node``:
    whether the hierarchical form quantizes its stage inside the node too (ZeRO++'s form) or sends it in fp32.
    ``codes``: ``"int"`` (``bits``-bit integers) or ``"fp8"`` (float8 e4m3 with the block's scale, 8 bits)."""

    def __init__(
        self, bits: int, block: int, comm: Comm, node: Comm | None = None, cross: Comm | None = None,
        compiled: bool = False, quantize_node: bool = True, draws: Draws | None = None, codes: str = "int",
    ):
        if (node is None) != (cross is None) or (node is not None and node.world_size * cross.world_size != comm.world_size):
            raise ValueError("a hierarchical qgZ needs a node and a cross-node group whose sizes multiply to the group's")
        self.quantizer = QuantizeKernels(BlockQuantizer(bits, block, codes), compiled)
        self.kind = "all_to_all_fp8" if codes == "fp8" else f"all_to_all_int{bits}"
        self.comm, self.node, self.cross = comm, node, cross
        self.quantize_node = quantize_node
        self.draws = draws  # stochastic rounding; None: to nearest

    @property
    def hierarchical(self) -> bool:
        return self.cross is not None

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, key: str) -> Handle:
        """Issue the reduction of ``full`` (``world x S`` elements) into ``out`` (S elements, this rank's part
        of the sum, written when the handle is waited). ``key``: the flat group's name (the draws')."""
        if self.cross is None:
            return self._exchange(self.comm, full.view(self.comm.world_size, -1), out, f"{key}/grad")
        m, n, s = self.node.world_size, self.cross.world_size, out.numel()
        # Inside the node: to the peer at place l go the rows of ranks j*m + l, for every node j.
        partial = self.quantizer.empty((n, s), torch.float32, out.device)
        rows = full.view(n, m, s).transpose(0, 1)
        inner = (self._exchange(self.node, rows, partial, f"{key}/grad-node") if self.quantize_node
                 else self._exact(self.node, rows, partial))
        return Chain(inner, lambda: self._exchange(self.cross, partial, out, f"{key}/grad-cross").then(
            lambda: self.quantizer.release(partial)))

    def _exchange(self, comm: Comm, rows: torch.Tensor, out: torch.Tensor, key: str) -> Handle:
        """Send quantized ``rows`` (``(world, ..., S)``: the first index is the destination) and sum, in fp32, the
        rows received into ``out`` (``(..., S)``)."""
        q, s = self.quantizer, out.shape[-1]
        send = _quantize(q, rows, self.draws, f"{comm.rank}/{key}")
        recv = q.empty(tuple(send.shape), torch.uint8, send.device)
        handle = comm.all_to_all(recv.view(-1), send.view(-1), self.kind, async_op=True)
        world = comm.world_size

        def land() -> None:
            values = q.dequantize(recv, s)
            _sum_rows(values.view(world, *out.shape), out)
            q.release(send, recv, values)

        return handle.then(land)

    def _exact(self, comm: Comm, rows: torch.Tensor, out: torch.Tensor) -> Handle:
        """``_exchange`` in full precision: the rows as they are, summed in fp32 into ``out``."""
        q = self.quantizer
        send = q.empty(tuple(rows.shape), rows.dtype, rows.device).copy_(rows)
        recv = q.empty(tuple(rows.shape), rows.dtype, rows.device)
        handle = comm.all_to_all(recv.view(-1), send.view(-1), "all_to_all", async_op=True)

        def land() -> None:
            torch.sum(recv, 0, dtype=torch.float32, out=out)
            q.release(send, recv)

        return handle.then(land)


def _quantize(q: QuantizeKernels, rows: torch.Tensor, draws: Draws | None, key: str) -> torch.Tensor:
    """``rows`` quantized by ``q``, rounded stochastically with ``draws``' noise for ``key`` when given."""
    if draws is None:
        return q.quantize(rows)
    noise = draws.uniform(key, q.quantizer.padded_numel(rows), rows.device, q.pool)
    send = q.quantize(rows, noise)
    q.release(noise)
    return send


def _sum_rows(values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the fp32 sum of ``values`` over its first dimension (written in place where ``out`` is fp32)."""
    if out.dtype == torch.float32:
        torch.sum(values, 0, out=out)
    else:
        out.copy_(values.sum(0))
