"""What makes the decode step static: batch buckets, persistent input buffers, compiled and
graph-captured step functions (docs/design.md §5).

* **Buckets.** A compiled or graph-captured decode batch of ``n`` requests runs padded to the
  smallest bucket >= n (``engine.batch_buckets``; eager ones only with ``engine.pad_batches``);
  padding rows write the caches' scratch slots and are never read.
  Block tables are padded to a power-of-two width, so shapes change only when a context
  doubles.
* **Persistent inputs.** :class:`StepBuffers` keeps one device tensor per input name and shape;
  the host copies each step's values into them, all of one dtype at once (host -> device
  only). Step after step of one
  bucket, the step functions see the same tensors (same ``data_ptr``): what CUDA-graph replay
  needs.
* **Step functions.** :class:`StepFunction` runs a function of tensors eagerly, through
  ``torch.compile`` (``engine.compile``), or, on CUDA, replays a CUDA graph captured per input
  shape (``engine.cuda_graphs``). The functions read nothing back to the host, so none of this
  changes what they compute.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch._inductor.custom_graph_pass

from inkfw.models.inkling.layers import static_moe

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n`` (``n`` itself when it exceeds every bucket)."""
    for b in sorted(buckets):
        if b >= n:
            return b
    return n


def captures_cuda_graphs(device: torch.device) -> bool:
    """Whether step functions on ``device`` can be captured as CUDA graphs (``engine.cuda_graphs``;
    the tests' CPU stand-in for them, tests/helpers/cuda_graphs.py, says yes for the CPU)."""
    return device.type == "cuda"


@functools.cache
def _cpp_scheduling() -> Any:
    """Inductor's CPU scheduling class where it has the outer-loop fusion hook patched below."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
    except ImportError:  # pragma: no cover - a torch without inductor's C++ backend
        return None
    return CppScheduling if "can_fuse_vertical_outer_loop" in vars(CppScheduling) else None


class _NoOuterLoopFusionKey(torch._inductor.custom_graph_pass.CustomGraphPass):
    """A post-grad pass that changes nothing: its uuid keys inductor's on-disk graph cache, so a
    graph compiled with :func:`cpu_outer_loop_fusion_off` never shares an entry with one compiled
    without it (the patch itself is invisible to the cache key)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return "inkfw-cpu-outer-loop-fusion-off-v1"


def _never_fuse_outer_loops(self: Any, node1: Any, node2: Any) -> bool:
    return False


@contextlib.contextmanager
def cpu_outer_loop_fusion_off() -> Iterator[None]:
    """Compile with inductor's CPU outer-loop fusion off (torch 2.13 miscompiles it).

    Outer-loop fusion keeps an intermediate in a local buffer sized for one outer element; when
    vectorization then tiles that outer loop, the tile's elements share the buffer and all but
    the last read another row's values (pytorch/pytorch#185702). In the compiled plain verify
    step at batch 4 it hit the short convs' ``x + conv(x)`` ahead of the norm: rows 0-2 of every
    batch decoded other tokens than eager from the 7th-11th token on, row 3 exactly
    (tests/test_shipped_checkpoint.py). Without the fusion the steps keep their SIMD kernels:
    batched compiled steps ran about 1.4x faster than with SIMD off (``cpp.simdlen=1``, the first
    cure), batch 1 about as fast (benchmarks/history.md, "Tenth session")."""
    scheduling = _cpp_scheduling()
    if scheduling is None:
        yield
        return
    saved = vars(scheduling)["can_fuse_vertical_outer_loop"]
    scheduling.can_fuse_vertical_outer_loop = _never_fuse_outer_loops
    try:
        yield
    finally:
        scheduling.can_fuse_vertical_outer_loop = saved


def inductor_config_patches() -> dict[str, Any]:
    """Inductor config of the step functions' graphs: a no-op post-grad pass that keys the graph
    cache to :func:`cpu_outer_loop_fusion_off`, or, on a torch without the hook that patches, no
    SIMD kernels (``cpp.simdlen=1``), the other cure for the miscompile.

    No size, stride or alignment asserts on the graph's inputs: dynamo's guards already check the
    step's own inputs, and the rest are the model's parameters and the cache pools, fixed for the
    step function's life (:func:`_step_guards`). On the CPU the asserts were one Python call per
    input per step: ~340 in the verify step of the shipped checkpoint."""
    return {
        "post_grad_custom_post_pass": _NoOuterLoopFusionKey(),
        "size_asserts": False,
        "alignment_asserts": False,
        **({} if _cpp_scheduling() is not None else {"cpp.simdlen": 1}),
    }


def _compile_step_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Dynamo's backend for the step functions: inductor, with its CPU outer-loop fusion off while
    it compiles the graph (the only time the fusion is decided; replays pay nothing)."""
    from torch._inductor.compile_fx import compile_fx

    with cpu_outer_loop_fusion_off():
        return compile_fx(gm, example_inputs, config_patches=inductor_config_patches())


MIN_TABLE_WIDTH = 4  # blocks: short contexts share one shape
MIN_PREFILL_WIDTH = 16  # tokens: short prompt chunks share one shape


def power_of_two_bucket(n: int, smallest: int) -> int:
    """The next power of two >= ``n``, at least ``smallest``."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def prefill_width(tokens: int) -> int:
    """Width of a static prompt-chunk batch whose longest chunk has ``tokens`` tokens: the next
    power of two, at least :data:`MIN_PREFILL_WIDTH`."""
    return power_of_two_bucket(tokens, MIN_PREFILL_WIDTH)


def table_width(blocks: int) -> int:
    """Block-table width for a row that needs ``blocks`` blocks: the next power of two, at least
    :data:`MIN_TABLE_WIDTH`."""
    return power_of_two_bucket(blocks, MIN_TABLE_WIDTH)


def flat_tables(tables: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """A step function's table arguments: ``table, base`` of each group of ``tables`` (from
    ``KVManager.step_tables``), in its order; :func:`table_views` undoes it inside the function."""
    return [t for table_and_base in tables.values() for t in table_and_base]


def table_views(groups: Sequence[int], flat: Sequence[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{group: (table, base)}`` of ``groups`` from table arguments laid out by
    :func:`flat_tables` (extra arguments after them are ignored)."""
    return {gi: (flat[2 * i], flat[2 * i + 1]) for i, gi in enumerate(groups)}


class StepBuffers:
    """Persistent device tensors, one per (name, shape, dtype), refilled from host values.

    Host values (lists, or lists of equal-length lists) staged between two :meth:`flush` calls
    reach the device together: per dtype, one tensor of all of them is made on the device and
    one ``_foreach_copy_`` spreads it over the buffers (the engine stages masks as 0 / 1 integers,
    which its step functions turn into bools, so that a flush is one copy, not two; on a GPU a
    copy from pageable host memory also waits for the stream). Call :meth:`flush` before the step
    function reads the buffers. Values already in a tensor are copied at once. On a GPU each
    copy is a launch and, from a slow host, ~50 us of dispatch, and a drafting round stages ~60
    buffers. The buffers are separate tensors: a compiled step sees no inputs that alias."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._flat: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # 1-d views of those
        self._pending: dict[torch.dtype, list[tuple[torch.Tensor, list[Any]]]] = {}
        self.num_copies = 0  # host -> device copies so far (one per dtype per flush, and tensor stages)

    def stage(self, name: str, values: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """The persistent tensor for ``name`` that holds ``values`` (a tensor now; host values
        once :meth:`flush` has run; rows of no values copy nothing)."""
        if isinstance(values, torch.Tensor):
            buf = self._buffer((name, tuple(values.shape), dtype))
            buf.copy_(values)
            self.num_copies += 1
            return buf
        flat, shape = _flatten(values)
        key = (name, shape, dtype)
        buf = self._buffer(key)
        if flat:
            self._pending.setdefault(dtype, []).append((self._flat[key], flat))
        return buf

    def flush(self) -> None:
        """Copy the staged host values to their buffers: one tensor and one copy per dtype."""
        for dtype, pending in self._pending.items():
            if pending:
                values = torch.tensor([v for _, flat in pending for v in flat], dtype=dtype, device=self.device)
                parts = values.split([len(flat) for _, flat in pending])
                torch._foreach_copy_([buf for buf, _ in pending], list(parts))  # pyright: ignore[reportPrivateImportUsage]
                self.num_copies += 1
        self._pending.clear()

    def _buffer(self, key: tuple[str, tuple[int, ...], torch.dtype]) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(key[1], dtype=key[2], device=self.device)
            self._flat[key] = buf.view(-1)
        return buf

    def __len__(self) -> int:
        return len(self._buffers)


def _flatten(values: Any) -> tuple[list[Any], tuple[int, ...]]:
    """(values in row-major order, shape) of a list or a list of equal-length lists."""
    values = list(values)
    if values and isinstance(values[0], (list, tuple)):
        width = len(values[0])
        if any(len(row) != width for row in values):
            raise ValueError(f"stage: rows of unequal length {sorted({len(row) for row in values})}")
        return [v for row in values for v in row], (len(values), width)
    return values, (len(values),)


def _raise_recompile_limit(limit: int = 1024) -> None:
    """Each MTP depth and batch bucket is its own specialisation of the same code: let dynamo keep
    them all rather than fall back to eager after the default 8."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < limit:
            setattr(config, name, limit)


def _step_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo guards a compiled step function keeps: none on module parameters, none on the cache
    pools and slot tags it reads through its ``kv`` closure; the rest (its inputs' shapes and
    dtypes, global state) stay. Serving never swaps a module's weights under a compiled step, and
    a step function is bound to one KV manager, whose pools live as long as it does (the
    component caches the function on first use, closure and all); step functions name that
    closure ``kv``. Skipping the pools' guards (89 tensors on the shipped checkpoint, each
    checked and alias-checked) halved dynamo's cache lookup: ~0.2 -> ~0.1 ms per call.

    Sound only because no other step function can reach the graphs compiled under these guards:
    dynamo keeps its graphs per code object, which every closure of one ``def`` shares, so each
    :class:`StepFunction` compiles a private copy of its function (:func:`private_code`)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [k and not (e.name == "kv" or e.name.startswith(("kv.", "kv["))) for k, e in zip(keep, entries)]


def private_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (same globals, closure, defaults), so that dynamo's
    graphs for it, kept per code object, serve this function only.

    The step functions' guards leave out their parameters and cache pools (:func:`_step_guards`).
    With the ``def`` shared, a second engine in the process ran the first one's graphs whenever
    its inputs matched: pools of another block size, or another model's weights, read and written
    with the first one's sizes (a compiled engine with ``kv.block_size=8`` after one with 4 emitted
    other tokens than eager; a smaller pool corrupted the heap). Each engine now traces its own
    graphs; inductor's cache, keyed by graph and input sizes, still spares the compile."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"a compiled step function must be a plain function or closure, got {type(fn).__name__}")
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


class StepFunction:
    """``fn(*tensors) -> tensor or tuple of tensors`` run eagerly, compiled, or as CUDA graphs.

    ``compile``: wrap ``fn`` in ``torch.compile`` with ``fullgraph=True`` (a graph break is an
    error), static shapes except the block-table widths (args from ``tables_from`` on), so one
    graph per batch bucket and k serves every context length. ``dynamic=False``: a new bucket or
    k compiles a graph of its own, where dynamo's default would turn a dimension symbolic at its
    second value (the verify width under adaptive k: minutes of compile on the CPU, slower
    steps). Static shapes run about 1.3x faster than fully dynamic ones on the shipped checkpoint
    (CPU). ``cuda_graphs``: capture one graph per tuple of input shapes on first use and replay
    it afterwards; the inputs must be the same persistent tensors each time
    (:class:`StepBuffers`), and the outputs are the graph's own tensors, overwritten by the next
    replay. ``warmup_s`` adds up compile and capture time.

    ``dynamic_dims``: ``(argument, dimension)`` pairs left symbolic when compiled (spans of any
    length, eager-shaped rounds: :meth:`MtpDrafter.round <inkfw.speculative.drafters.mtp.MtpDrafter.round>`).
    Dynamo still specialises sizes 0 and 1, so such a function compiles at most one graph per
    pattern of sizes <= 1 in those dimensions. Not with ``cuda_graphs`` (a capture is one shape).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        compile: bool = False,
        cuda_graphs: bool = False,
        tables_from: int = 0,
        dynamic_dims: Sequence[tuple[int, int]] = (),
    ):
        if dynamic_dims and cuda_graphs:
            raise ValueError(f"step function {name}: a CUDA graph has one shape, it takes no dynamic dimensions")
        self.name = name
        self.tables_from = tables_from  # args from here on are block tables [B, W] and bases [B]
        self.dynamic_dims = tuple(dynamic_dims)
        self.eager = fn
        if compile:
            _raise_recompile_limit()
        self.fn = (
            # parameters and cache pools go unguarded (_step_guards): their guards cost about
            # 1.1 ms per call on the shipped checkpoint; a private copy of the function keeps its
            # graphs its own. A fresh dict each time: torch.compile pops the option from it.
            torch.compile(
                private_code(fn),
                backend=_compile_step_graph,
                fullgraph=True,
                dynamic=False,
                options={"guard_filter_fn": _step_guards},
            )
            if compile
            else fn
        )
        self.compiled = compile
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple, tuple[Any, tuple[torch.Tensor, ...], Any]] = {}
        self._seen: set[tuple] = set()
        self.warmup_s = 0.0

    def __call__(self, *args: torch.Tensor) -> Any:
        with static_moe():  # no MoE host reads, whatever the batch: static shapes throughout
            return self._call(args)

    @staticmethod
    def shape_key(args: Sequence[torch.Tensor]) -> tuple:
        """What a compiled graph or a CUDA graph is specific to: each input's shape, dtype and
        storage (a new persistent buffer is a new capture)."""
        return tuple((tuple(a.shape), a.dtype, a.data_ptr()) for a in args)

    def _key(self, args: Sequence[torch.Tensor]) -> tuple:
        """:meth:`shape_key`, or with dynamic dimensions: shapes and dtypes, each dynamic size
        counted as 0, 1 or more (what dynamo specialises on), the inputs' storage left out."""
        if not self.dynamic_dims:
            return self.shape_key(args)
        sizes = [list(a.shape) for a in args]
        for i, d in self.dynamic_dims:
            sizes[i][d] = min(sizes[i][d], 2)
        return tuple((tuple(s), a.dtype) for s, a in zip(sizes, args))

    def _call(self, args: tuple[torch.Tensor, ...]) -> Any:
        key = self._key(args)
        if self.compiled:  # fresh tensors each call: dynamo reads the marks when it (re)compiles
            for i, d in self.dynamic_dims:
                torch._dynamo.maybe_mark_dynamic(args[i], d)
        if key in self._seen:
            if not self.cuda_graphs:
                return self.fn(*args)
            graph, _, out = self._graphs[key]
            graph.replay()
            return out
        # first call of this shape: compiles (compile), or runs once and is captured for the
        # calls after it (CUDA graphs); both count as warm-up
        if self.compiled:
            for a in args[self.tables_from :]:  # one compiled graph for every table width (context length)
                if a.dim() == 2:
                    torch._dynamo.mark_dynamic(a, 1)
        if self.cuda_graphs:
            self._graphs[key], out = self._capture(args)
        else:
            t = time.perf_counter()
            out = self.fn(*args)
            if self.compiled:
                self.warmup_s += time.perf_counter() - t
        self._seen.add(key)
        return out

    def _capture(self, args: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, tuple[torch.Tensor, ...], Any], Any]:
        """Run ``fn`` on ``args`` once for real, then capture its graph: ``((graph, args, graph
        outputs), this call's outputs)``.

        The step functions update state in place (the caches, the drafter's hidden tail, the
        ext buffer its drafts are written into), so a warm-up run more than this call's would
        apply them twice. One real run, on a side stream, does what warm-up runs are for
        (compile, cuBLAS handles, allocator pools); capture records the kernels without running
        them."""
        t = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = self.fn(*args)  # this call's step: its effects, once
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*args)  # recorded, not run
        torch.cuda.synchronize()
        self.warmup_s += time.perf_counter() - t
        return (graph, args, out), first


class StepModes:
    r"""Mixin for a component that runs :class:`StepFunction`\ s (the verifier, the MTP drafter):
    how they run (:meth:`set_step_mode`, chosen by the engine), one function per key, built on
    first use, and their compile / capture seconds (:attr:`warmup_s`)."""

    _compile = False
    _cuda_graphs = False

    @property
    def _steps(self) -> dict[Hashable, StepFunction]:
        return self.__dict__.setdefault("_step_functions", {})

    @property
    def cuda_graphs(self) -> bool:
        """Whether the step functions replay CUDA graphs."""
        return self._cuda_graphs

    def set_step_mode(self, compile: bool = False, cuda_graphs: bool = False) -> None:
        """Run the step functions compiled (``torch.compile``) and/or as CUDA graphs."""
        self._compile, self._cuda_graphs = compile, cuda_graphs
        self._steps.clear()

    @property
    def warmup_s(self) -> float:
        return sum(f.warmup_s for f in self._steps.values())

    def _step_function(
        self,
        key: Hashable,
        fn: Callable[..., Any],
        name: str,
        tables_from: int,
        dynamic_dims: Sequence[tuple[int, int]] = (),
    ) -> StepFunction:
        """The step function for ``key``: ``fn`` wrapped in the current mode on first use
        (``dynamic_dims``: compiled with those dimensions symbolic, never graph-captured)."""
        if key not in self._steps:
            self._steps[key] = StepFunction(
                fn,
                name,
                compile=self._compile,
                cuda_graphs=self._cuda_graphs and not dynamic_dims,
                tables_from=tables_from,
                dynamic_dims=dynamic_dims,
            )
        return self._steps[key]
