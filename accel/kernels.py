"""Few-row CPU products: same-signature drop-ins for `nn.Linear`'s x·Wᵀ + b on the rows of a decode step.

`FewRowsLinear` is `nn.Linear` (same parameters and state dict) whose forward, on CPU, runs a product of 1-16 rows
through `FEW_ROWS_KERNEL`, which times the equal products of each weight shape on first use and keeps the fastest,
as `torch.backends.cudnn.benchmark` picks convolution kernels. On any other device, and for more rows, it is
F.linear. Choices are keyed by weight shape, rows, threads, dtype and this CPU, never stored on a module.
"""

from __future__ import annotations

import collections
import functools
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.weak
from torch import nn

# Weights of fewer elements stay in cache, where `linear_forward`'s few-row kernel costs more than it saves.
FEW_ROWS_MIN_WEIGHT = 1 << 16
# The most rows for which `linear_forward` weighs other products against F.linear: a decode step of a batch of up to 16.
FEW_ROWS_MAX = 16
FEW_ROWS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FewRowsKernel:
    """Picks, per (weight shape, rows, torch threads), the fastest of equal products for an eager CPU product of a
    few rows, as `torch.backends.cudnn.benchmark` picks convolution kernels. The candidates:

    - "linear": F.linear's x·Wᵀ, the standard the others must beat;
    - "transposed": (W·Xᵀ)ᵀ, MKL's GEMM of W·[x; 0]ᵀ, which some CPUs stream faster than their GEMV;
    - "blocks2/4/8": x·Wᵀ as one batched GEMM over s blocks of W's rows, which MKL streams on separate threads where
      its GEMV of one row keeps to one;
    - "mv": for one row, W·x as a matrix-vector product;
    - "int8pack": `torch._weight_int8pack_mm` for a weight-only int8 weight (`weight_only_int8`) with bf16 rows, the
      kernel inductor lowers torchao's product to (torchao runs it eagerly as the whole weight converted and a GEMM);
    - "packed": oneDNN's linear on a prepacked copy of a bf16 weight where no gradient flows (`packed_weight`, as
      inductor's freezing prepacks), which costs the weight's memory again and is kept only where its key takes it
      (`FewRowsKernel.prepack = False` packs none from then on, `FewRowsKernel.packed.clear()` drops those made);
    - in a compiled walk only: "reduce", Σ_k x_k·W_nk as a float32 reduction that inductor emits as one vectorised
      pass over W (`reduce_product`), and "int8reduce", its int8 twin.

    The winner differs between CPUs, dtypes, row counts and thread counts (docs/performance.md has the
    measurements). The first `trials` calls of each candidate per key take turns on the model's own weights, timed
    where they run, so W is as cold as in a decode step; another product wins only if its median is below `margin` ×
    the standard's, since per-call times on a shared machine scatter. `medians` keeps every candidate's median per key.
    `forced` (a product's name; F.linear where it does not apply) skips the timing; under
    `torch.use_deterministic_algorithms(True)` F.linear runs, so that no result depends on a timing."""

    trials = 9
    margin = 0.9
    forced: str | None = None
    prepack = True
    # Prepacked copies by weight (weak: they go with it), each with the weight's (version, data pointer) when packed,
    # so an in-place update or new storage packs again.
    packed = torch.utils.weak.WeakIdKeyDictionary()
    blocks = {"blocks2": 2, "blocks4": 4, "blocks8": 8}
    min_block_rows = 64
    reduce_kernels: dict[tuple, object] = {}  # `compiled_reduce`'s, by the shapes and dtypes of its arguments

    def __init__(self):
        # Keyed by (*weight shape, rows, threads, dtype of the stored elements); a weight-only int8 weight's ends with
        # int8 and the dtype of its rows.
        self.chosen: dict[tuple, str] = {}
        self.medians: dict[tuple, dict[str, float]] = {}  # seconds per call, by product
        self.walk_medians: dict[tuple, dict[str, float]] = {}  # the same, timed for a compiled walk (`choose`)
        self.timings: dict[tuple, dict[str, list[float]]] = {}

    @classmethod
    def candidates(cls, weight: torch.Tensor, rows: int) -> tuple[str, ...]:
        """F.linear first, then the products that apply to this weight (blocks of `min_block_rows`+ whole rows; int8
        weights: int8pack alone) and this many rows (W·x: one)."""
        if weight_only_int8(weight):
            return ("linear", "int8pack")
        N = weight.shape[0]
        blocks = (k for k, s in cls.blocks.items() if N % s == 0 and N // s >= cls.min_block_rows)
        packed = cls.prepack and weight.dtype == torch.bfloat16 and not weight.is_inference() and cpu_has_mkldnn_bf16()
        return ("linear", "transposed", *blocks, *(("mv",) if rows == 1 else ()), *(("packed",) if packed else ()))

    @classmethod
    def traced_candidates(cls, weight: torch.Tensor, rows: int, reduce: bool = True) -> tuple[str, ...]:
        """The products a compiled walk can take (`traced_product`): `candidates` but W·x, which has no form for a
        symbolic row count, and, where `reduce` (the walk is inductor's, which fuses it), for one row of a plain float
        CPU weight the float32 reduction ("reduce"). The first is the standard the others must beat. A weight-only int8
        weight has `torch._weight_int8pack_mm` ("int8pack", the kernel inductor's pattern matcher lowers torchao's
        product to) and, where `reduce`, for one row its float32 reduction ("int8reduce")."""
        if weight_only_int8(weight):
            # Both explicit, so the walk needs no pattern matcher to lower torchao's product (`compile_decode`).
            return ("int8pack", "int8reduce") if reduce and rows == 1 and weight.is_cpu else ("int8pack",)
        kinds = tuple(k for k in cls.candidates(weight, rows) if k != "mv")
        plain = type(weight) in (torch.Tensor, nn.Parameter) and weight.is_cpu and weight.dtype.is_floating_point
        return (*kinds, "reduce") if reduce and rows == 1 and plain else kinds

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        if self.forced is not None:
            kind = self.forced if self.forced in self.candidates(weight, rows) else "linear"
            kind = kind if kind != "packed" or self.packable(x, weight) else "linear"
            return self.product(x, weight, bias, rows, kind)
        key = self.key(weight, rows)
        kind = self.chosen.get(key)
        # F.linear first and without another call: it is the choice for many keys, and this runs ~580 times a step.
        if kind == "linear" or torch.are_deterministic_algorithms_enabled():
            return F.linear(x, weight, bias)
        if kind is not None:
            kind = kind if kind != "packed" or self.packable(x, weight) else "linear"
            return self.product(x, weight, bias, rows, kind)
        timings = self.timings.setdefault(key, {k: [] for k in self.candidates(weight, rows)})
        kinds = [k for k in timings if k != "packed" or self.packable(x, weight)]
        kind = min(kinds, key=lambda k: len(timings[k]))  # take turns, in candidate order
        if kind == "packed":
            self.packed_weight(weight)  # packing once per weight is not the product's time
        start = time.perf_counter()
        y = self.product(x, weight, bias, rows, kind)
        timings[kind].append(time.perf_counter() - start)
        if all(len(t) >= self.trials for t in timings.values()):  # more where gradients left out "packed"
            medians = self.medians[key] = {k: statistics.median(t) for k, t in timings.items()}
            self.chosen[key] = self._fastest(medians, medians)
            del self.timings[key]
            if self.chosen[key] != "packed":  # the trials' copies are not kept
                for w in [w for w in self.packed if self.key(w, rows) == key]:
                    del self.packed[w]
        return y

    def packable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether "packed" may multiply x by this weight now: prepacking on, no gradient to flow (the product has no
        derivative), and a weight that counts its in-place updates (not an inference tensor)."""
        return (self.prepack and not weight.is_inference()
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def _fastest(self, medians: dict[str, float], kinds) -> str:
        """The product of `kinds` with the lowest median, where that is below `margin` × the first's (the standard
        product: F.linear, or "int8pack" in a compiled walk); else the first."""
        standard = next(iter(kinds))
        best = min(kinds, key=medians.get)
        return best if medians[best] < self.margin * medians[standard] else standard

    def choose(self, weights: list[torch.Tensor], rows: int, stored: dict[str, str] | None = None,
               walk: list[torch.Tensor] | None = None, keep: list[torch.Tensor] = (), reduce: bool = True) -> list[str]:
        """The product a compiled walk takes for `rows` rows by each of `weights` (`compile_decode`): per key, the
        fastest of those it can trace (`traced_candidates`, the reduction only where `reduce`: another backend than
        inductor runs it unfused), timed now (`time_in_walk_order`) where no earlier call has. `stored` (product by
        torch version, CPU model and key) answers a key timed in an earlier process and takes this one's, so that a
        choice made once stays made (single timings scatter). `keep`: weights whose prepacked copy stays whatever this
        call takes (another row count's product takes it)."""
        if self.forced is not None:  # whatever the backend: a diagnostic's or a test's choice
            return [self.forced if self.forced in ks else ks[0]
                    for ks in (self.traced_candidates(w, rows) for w in weights)]
        kinds = [self.traced_candidates(w, rows, reduce) for w in weights]
        if torch.are_deterministic_algorithms_enabled():
            return ["linear"] * len(weights)
        keys = [self.key(w, rows) for w in weights]
        # The tag: choices timed otherwise, or without "packed" among the compiled products (earlier releases), are
        # timed again.
        names = [f"torch {torch.__version__} | {cpu_model()} | timed in walk rounds, packed and reduce traced | "
                 + " ".join(map(str, k)) for k in keys]
        known = {k for k, n, ks in zip(keys, names, kinds) if stored is not None and stored.get(n) in ks}
        # Timed again where an earlier call (another backend's walk) left a product out.
        pending = {k: ks for k, ks in zip(keys, kinds)
                   if k not in known and len(ks) > 1 and not set(ks) <= set(self.walk_medians.get(k, ()))}
        if pending:
            self.time_in_walk_order(weights, keys, pending, rows, walk)
        chosen, kept = [], {id(w) for w in keep}
        for weight, key, name, ks in zip(weights, keys, names, kinds):
            if key in known:
                kind = stored[name]
            else:  # a single candidate is not timed
                kind = ks[0] if len(ks) == 1 else self._fastest(self.walk_medians[key], ks)
            if stored is not None:
                stored[name] = kind
            # The timing's copy, unless a product takes it.
            if "packed" not in (kind, self.chosen.get(key)) and id(weight) not in kept:
                self.packed.pop(weight, None)
            chosen.append(kind)
        return chosen

    def time_in_walk_order(self, weights: list[torch.Tensor], keys: list[tuple], kinds: dict[tuple, list[str]],
                           rows: int, walk: list[torch.Tensor] | None) -> None:
        """Times the products `kinds` names per key (`keys`: each weight's) on `weights` as a compiled decode step
        runs them, into `walk_medians`: in rounds over `walk` (the weights a step reads, in its order; by default
        `weights`), each round one product per key for all its weights and every other weight read untimed by
        F.linear, so that each product finds its weight as cold as in a step and follows its own kind: timed over one
        shape alone, or alternating call by call, the choice can come out other than the compiled step's."""
        timed = {id(w): key for w, key in zip(weights, keys) if key in kinds}
        counts = collections.Counter(timed.values())
        read = {id(w) for w in walk or ()}
        walk = [*(walk or ()), *(w for w in weights if id(w) not in read)]
        # Rows of the dtype the weight multiplies (an int8 weight's: the dtype it dequantizes to).
        inputs = {(w.shape[1], w.dtype): torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in walk}
        for weight in walk:  # untimed: a weight's first read may fault its pages in (a model just loaded)
            x, weight_kinds = inputs[weight.shape[1], weight.dtype], kinds.get(timed.get(id(weight)), ())
            F.linear(x, weight)
            if "packed" in weight_kinds:
                self.packed_weight(weight)  # packing once per weight is not the product's time
            if "reduce" in weight_kinds:  # nor compiling it
                self.compiled_reduce(x, weight, None)
            if "int8reduce" in weight_kinds:
                self.compiled_reduce(x, weight.qdata, None, weight.scale)
        per_kind = max(2, *(-(-self.trials // n) for n in counts.values()))  # rounds per product, each key ≥ trials
        times = {k: {kind: [] for kind in ks} for k, ks in kinds.items()}
        for r in range(per_kind * max(map(len, kinds.values()))):
            for weight in walk:
                x, key = inputs[weight.shape[1], weight.dtype], timed.get(id(weight))
                if key is None:
                    F.linear(x, weight)
                    continue
                kind = kinds[key][r % len(kinds[key])]
                start = time.perf_counter()
                self.product(x, weight, None, rows, kind)
                times[key][kind].append(time.perf_counter() - start)
        for key, by_kind in times.items():
            self.walk_medians[key] = {kind: statistics.median(t) for kind, t in by_kind.items() if t}

    @staticmethod
    def key(weight: torch.Tensor, rows: int) -> tuple:
        plain = type(weight) in (torch.Tensor, nn.Parameter)  # first: this runs ~580 times a step
        if not plain and weight_only_int8(weight):  # and the dtype of its rows (float32 for the Memory Cache's)
            return (*weight.shape, rows, torch.get_num_threads(), torch.int8, weight.dtype)
        return (*weight.shape, rows, torch.get_num_threads(), weight.dtype)

    @classmethod
    def product(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, kind: str):
        """x·Wᵀ + b by the product named `kind` (see the class)."""
        if kind == "linear":
            return F.linear(x, weight, bias)
        if kind in cls.blocks:
            return cls.row_blocks_product(x, weight, bias, cls.blocks[kind])
        K = x.shape[-1]
        if kind == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, cls.packed_weight(weight), bias, "none", [], "")
        if kind == "reduce":
            return cls.compiled_reduce(x, weight, bias)
        if kind == "int8reduce":
            return cls.compiled_reduce(x, weight.qdata, bias, weight.scale)
        if kind == "int8pack":
            return cls.int8pack_product(x, weight.qdata, weight.scale, bias)
        if kind == "mv":
            y = torch.mv(weight, x.reshape(K))
        elif rows == 1:  # column 0 of W·[x; 0]ᵀ
            y = torch.mm(weight, F.pad(x.reshape(1, K), (0, 0, 0, 1)).t())[:, 0].contiguous()
        else:
            y = torch.mm(weight, x.reshape(rows, K).contiguous().t()).t().contiguous()
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    @classmethod
    def packed_weight(cls, weight: torch.Tensor) -> torch.Tensor:
        """oneDNN's prepacked copy of bf16 `weight` for its linear, packed again after the weight changed."""
        tag = (weight._version, weight.data_ptr())
        entry = cls.packed.get(weight)
        if entry is None or entry[0] != tag:
            # Never an inference tensor: a later step may run outside inference mode.
            with torch.inference_mode(False), torch.no_grad():
                entry = cls.packed[weight] = (tag, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        return entry[1]

    @classmethod
    def traced_product(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        """The product named `kind` (not "mv") in a compiled graph, for any (symbolic) number of rows: the float32
        reduction (`reduce_product`); row blocks as eagerly; (W·Xᵀ)ᵀ as the first columns of W·[X; 0]ᵀ, as eagerly
        for one row (a one-column GEMM takes the slow path that F.linear's does); and the prepacked linear as the op
        `spike_whale::packed_linear` (`packed_linear`), where no gradient flows. A choice that does not apply to this
        weight (made for another device or dtype) is F.linear."""
        if (not weight.is_cpu or kind.startswith("int8") != hasattr(weight, "qdata")
                or (kind == "packed" and weight.dtype != torch.bfloat16)):
            return F.linear(x, weight, bias)
        if kind in cls.blocks:
            return cls.row_blocks_product(x, weight, bias, cls.blocks[kind])
        if kind == "packed" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return torch.ops.spike_whale.packed_linear(x, weight, bias)
        if kind == "reduce":
            return cls.reduce_product(x, weight, bias)
        if kind == "int8reduce":
            return cls.reduce_product(x, weight.qdata, bias, weight.scale)
        if kind == "int8pack":  # opaque: inductor's own lowering of it takes no scale converted in the graph
            return torch.ops.spike_whale.int8pack_linear(x, weight.qdata, weight.scale, bias)
        if kind != "transposed":
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        # Row-major, as F.linear's and the eager product's: a strided result would reach the slot states (the
        # Memory-Cache sums of a fused projection's q/k/v) and change their strides, and with them the next step's
        # guards (one more compile).
        y = torch.mm(weight, F.pad(x2, (0, 0, 0, 1)).t())[:, : x2.shape[0]].t().contiguous()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def reduce_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
        """x·Wᵀ + b as Σ_k x_k·W_nk + b_n in float32, rounded to x's dtype once (F.linear's function): compiled, one
        pass over W per row of x. With `scale` (W an int8 weight's values), Σ_k x_k·W_nk is multiplied by s_n rounded
        to x's dtype before the bias (`int8pack_product`'s function)."""
        y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
        if scale is not None:
            y = y * scale.reshape(-1).to(x.dtype).float()
        return (y if bias is None else y + bias.float()).to(x.dtype)

    @staticmethod
    def int8pack_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """torchao's weight-only int8 y = (x·qᵀ)·s + b by `torch._weight_int8pack_mm` (s rounded to x's dtype, the
        products accumulated in float32); also the op `spike_whale::int8pack_linear` of a compiled walk."""
        K = x.shape[-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, K), qdata, scale.reshape(-1).to(x.dtype))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], qdata.shape[0])

    @classmethod
    def compiled_reduce(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
        """`reduce_product` as inductor compiles it for these shapes and dtypes (compiled once per process and kept
        in `reduce_kernels`), for timing it outside a compiled walk: called directly, without dynamo's guards, so
        that its time is close to its time inside the walk's graph."""
        given = {k: t for k, t in (("bias", bias), ("scale", scale)) if t is not None}
        args = (x, weight, *given.values())
        key = tuple((a.shape, a.dtype) for a in args)  # an int8 weight, and only it, comes with a scale
        kernel = cls.reduce_kernels.get(key)
        if kernel is None:
            from torch.fx.experimental.proxy_tensor import make_fx

            def product(x, weight, *rest):
                return cls.reduce_product(x, weight, **{"bias": None, **dict(zip(given, rest))})

            kernel = cls.reduce_kernels[key] = torch._inductor.compile(make_fx(product)(*args), list(args))
        return kernel(*args)

    @staticmethod
    def row_blocks_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, s: int) -> torch.Tensor:
        """x·Wᵀ + b as one batched GEMM [s, rows, K] × [s, K, N/s] over s blocks of W's rows (views; x broadcast)."""
        K, N = x.shape[-1], weight.shape[0]
        y = torch.bmm(x.reshape(1, -1, K).expand(s, -1, K), weight.unflatten(0, (s, N // s)).transpose(1, 2))
        y = y.transpose(0, 1).reshape(-1, N)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], N)


FEW_ROWS_KERNEL = FewRowsKernel()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x·Wᵀ + b by oneDNN's linear on W's prepacked copy (`FewRowsKernel.packed_weight`): the op
    `spike_whale::packed_linear`, which a compiled decode walk calls as an opaque kernel. Inductor lowers oneDNN's
    own op only for a weight frozen into the graph as a constant, and the walk reads its weights as inputs."""
    return torch.ops.mkldnn._linear_pointwise(x, FewRowsKernel.packed_weight(weight), bias, "none", [], "")


_SPIKE_WHALE_OPS = torch.library.Library("spike_whale", "FRAGMENT")
for _name, _schema, _impl in (
    ("packed_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", packed_linear),
    ("int8pack_linear", "(Tensor x, Tensor qdata, Tensor scale, Tensor? bias) -> Tensor",
     FewRowsKernel.int8pack_product),
):
    if not hasattr(torch.ops.spike_whale, _name):  # once per process, whichever copy of this file comes first
        _SPIKE_WHALE_OPS.define(_name + _schema)
        _SPIKE_WHALE_OPS.impl(_name, _impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"spike_whale::{_name}", lib=_SPIKE_WHALE_OPS)(
            lambda x, weight, *rest: x.new_empty(*x.shape[:-1], weight.shape[0]))


def weight_only_int8(weight: torch.Tensor) -> bool:
    """Whether `weight` is an int8 weight with one scale per output row and float activations: torchao's
    `Int8WeightOnlyConfig`, through transformers' `TorchAoConfig`, whose product is y = (x·qᵀ)·s."""
    q = getattr(weight, "qdata", None)
    return (isinstance(q, torch.Tensor) and q.dtype == torch.int8 and q.dim() == 2 and q.is_contiguous()
            and getattr(weight, "act_quant_kwargs", True) is None and getattr(weight, "act_pre_scale", True) is None
            and list(getattr(weight, "block_size", ())) == [1, q.shape[1]]
            and getattr(weight, "scale", None) is not None and weight.scale.numel() == q.shape[0])


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def cpu_has_mkldnn_bf16() -> bool:
    """Whether oneDNN's bf16 linear on prepacked weights (`FewRowsKernel`'s "packed") runs here: the op exists and
    this CPU has the instructions its bf16 path needs (an AVX2-only CPU raises at the reorder)."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has bf16 instructions on this CPU (AVX512-BF16 or AMX); a torch built without oneDNN cannot
    tell, and keeps its bf16 kernels."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


# The fewest rows whose bf16 CPU product runs in float32 where the CPU has no bf16 instructions: there MKL's bf16
# GEMM is several times slower than converting both sides and running its float32 one, while one row stays bf16
# (half the weight bytes to stream).
BF16_AS_FLOAT32_MIN_ROWS = 8

# The rows a compiled walk's batch products are timed at (`choose_compiled_products`): one graph serves every batch
# of 2 or more, so one representative count picks their product.
COMPILED_BATCH_ROWS = 8


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   compiled_product: str = "linear") -> torch.Tensor:
    """x·Wᵀ + b, as F.linear. Eagerly, a product of 1-`FEW_ROWS_MAX` rows with a plain float32, bf16 or float16
    row-major W of at least `FEW_ROWS_MIN_WEIGHT` elements on CPU (a decode step; a speculative verify chunk; an MTP
    verify step's `lm_head` product) runs through `FEW_ROWS_KERNEL`, the fastest of its equal products on this
    machine, as does a product of bf16 rows with a weight-only int8 W (`weight_only_int8`) where no gradient flows
    to x (`_weight_int8pack_mm` has no derivative); a bf16 product of `BF16_AS_FLOAT32_MIN_ROWS`+ rows on a CPU
    without bf16 instructions runs in float32 and is rounded to bf16 once, the function of a native bf16 GEMM
    (float32 accumulation, one rounding). Under torch.compile inductor picks its own GEMM, of the product
    `compiled_product` names where that is given (`compile_decode`)."""
    # First: under compile a test of the (symbolic) row count would guard the graph on it, and dynamo cannot trace
    # the kernel's get_num_threads.
    if torch.compiler.is_compiling():
        return FewRowsKernel.traced_product(x, weight, bias, compiled_product)
    if not x.is_cpu:
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if type(weight) not in (torch.Tensor, nn.Parameter):
        if (0 < rows <= FEW_ROWS_MAX and x.dtype == torch.bfloat16 and weight.numel() >= FEW_ROWS_MIN_WEIGHT
                and not (x.requires_grad and torch.is_grad_enabled()) and weight_only_int8(weight)):
            return FEW_ROWS_KERNEL(x, weight, bias, rows)
        return F.linear(x, weight, bias)
    if rows >= BF16_AS_FLOAT32_MIN_ROWS and x.dtype == weight.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    if not (0 < rows <= FEW_ROWS_MAX and x.dtype == weight.dtype and x.dtype in FEW_ROWS_DTYPES
            and weight.numel() >= FEW_ROWS_MIN_WEIGHT and weight.stride(-1) == 1):
        return F.linear(x, weight, bias)
    return FEW_ROWS_KERNEL(x, weight, bias, rows)


# The products a compiled decode walk multiplies by, per problem (`product_key`): `compile_decode` fills it
# (`choose_compiled_products`) and the walk's trace reads it (`compiled_kind`). Keyed by the weight's device, dtype,
# shape and form, never by module: a model moved to another device or dtype finds none of its choices.
COMPILED_PRODUCTS: dict[tuple, str] = {}


def product_key(weight: torch.Tensor, several: bool) -> tuple:
    """The `COMPILED_PRODUCTS` key of a product by `weight` of one row (several=False) or of a batch's rows."""
    return (weight.device.type, weight.dtype, tuple(weight.shape), hasattr(weight, "qdata"), several)


def compiled_kinds(owner) -> tuple[str, str]:
    """The products (one row, several rows) a compiled walk multiplies `owner`'s weight by ("linear": F.linear)."""
    return tuple(COMPILED_PRODUCTS.get(product_key(owner.weight, several), "linear") for several in (False, True))


def compiled_kind(owner, x: torch.Tensor) -> str:
    """The product `owner` (a FewRowsLinear or FusedLinears) multiplies x by in a compiled decode walk. A compiled step
    has one row per sequence, and dynamo specialises a batch of one, so a batch-1 graph and the graph of larger
    batches each trace their own (and dynamo guards on the entry read)."""
    if not torch.compiler.is_compiling():
        return "linear"
    return COMPILED_PRODUCTS.get(product_key(owner.weight, x.numel() != x.shape[-1]), "linear")


class FewRowsLinear(nn.Linear):
    """nn.Linear computed by `linear_forward` (same parameters and state dict), multiplied in a compiled decode walk by
    the product `compiled_kind` names (a `FewRowsKernel` product; "linear": F.linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(x, self.weight, self.bias, compiled_kind(self, x))

    def _apply(self, fn, recurse=True):
        # Moved or re-typed: the prepacked copy was made for the weight as it was.
        FewRowsKernel.packed.pop(self.weight, None)
        return super()._apply(fn, recurse)

