"""FP8 GEMMs through torch's own scaled GEMMs (`execution.fp8=torch`), in three recipes.

`execution.fp8_recipe=tensor` is Transformer Engine's "current scaling" with its HYBRID format: every operand is
scaled per tensor from its own absolute maximum at the moment it is quantised (no amax history,
so nothing to checkpoint or to warm up), activations and weights in E4M3, output gradients in E5M2
(wider range, fewer bits: gradients span more decades than they need digits). Weights are
quantised from the float32 master weights on every call (one rounding, not bf16 then FP8), and
the optimizer only ever sees float32. The dense linears of attention and MLPs and the experts'
grouped GEMMs run in FP8; the router, a shared expert's gate, the embedding and the LM head stay
in the compute dtype, as in TE-based trainers (they are small, or precision-sensitive, or both).

Forward and both backward products are FP8 x FP8 with float32 accumulation, so each of the three
GEMMs of a linear layer runs on FP8 tensor cores. The quantised operands are what autograd
saves: an FP8 activation is half the bytes of a bf16 one.

cuBLAS's FP8 GEMM wants the second operand column-major, and both the contraction length and
the output width multiples of 16. The contraction of a weight gradient is over tokens, so rows
are zero-padded to a multiple of 16 there (zeros add nothing to a sum). Widths are the model's
and are checked with a one-line error. On CPU `_scaled_mm` runs too (slowly: it is the reference
the tests use); `execution.fp8=torch` is refused on devices without FP8 tensor cores.

`execution.fp8_recipe=block` (`BlockScaling`) scales 1 x 128 runs of activations and gradients and
128 x 128 weight blocks instead, through `torch.nn.functional.scaled_mm`'s blockwise modes on
Hopper; on CPU from the dequantised operands (the tests' reference). `execution.fp8_recipe=delayed`
(`DelayedScaling`) takes the activations' and gradients' scales from the amax of earlier steps.

Shape legend: M rows (tokens), K contraction, N output features, E experts, D / F the experts'
input / output widths; R x C a quantised matrix of any role.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx_moe.choices import check_choice
from longctx_moe.kernels import fp8_grouped

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_CHOICES = ("none", "torch", "te")
_ALIGN = 16  # cuBLAS FP8: contraction and output widths in multiples of 16 elements
BLOCK = 128  # execution.fp8_recipe=block: the length of a scaled run (and the side of a weight block)


def unavailable_reason(setting: str, device, tp: int = 1, recipe: str = "tensor") -> str | None:
    """None when `execution.fp8=setting` (with `execution.fp8_recipe=recipe`) can run on `device`, else
    one cause-and-fix sentence."""
    device = torch.device(device)
    if setting == "none":
        return None
    if setting == "te":
        return ("execution.fp8=te: the Transformer Engine path is not built (its wheels cannot be installed "
                "or run where this project is tested); execution.fp8=torch runs TE's recipes (execution.fp8_recipe="
                "tensor | delayed | block) through torch's FP8 GEMMs; or set execution.fp8=none")
    if setting != "torch":
        return f"execution.fp8={setting!r} is not one of {FP8_CHOICES}"
    if tp > 1:
        return (f"execution.fp8=torch with parallel.tp={tp}: the tensor-parallel projections run their own "
                "GEMMs and are not FP8 yet; set parallel.tp=1 or execution.fp8=none")
    if device.type != "cuda":
        return f"execution.fp8=torch needs a CUDA GPU with FP8 tensor cores, not {device.type}; set execution.fp8=none"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return (f"execution.fp8=torch needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); "
                f"{_gpu(device)}; set execution.fp8=none")
    if recipe == "block":
        return _block_unavailable_reason(device)
    return None


def _block_unavailable_reason(device: torch.device) -> str | None:
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm"):
        return (f"execution.fp8_recipe=block needs torch.nn.functional.scaled_mm's blockwise scaling, which "
                f"torch {torch.__version__} lacks; set execution.fp8_recipe=tensor")
    if torch.cuda.get_device_capability(device)[0] != 9:
        return (f"execution.fp8_recipe=block: torch's blockwise-scaled FP8 GEMM runs on Hopper (compute "
                f"capability 9.x); {_gpu(device)}; set execution.fp8_recipe=tensor")
    return None


def _gpu(device: torch.device) -> str:
    """'<GPU name> has <compute capability>', for a refusal."""
    cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return f"{torch.cuda.get_device_name(device)} has {cap}"


def quantize(x: torch.Tensor, fp8: torch.dtype, dims: tuple[int, ...] | None = None,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in `fp8`, its float32 dequantisation factor): x ~ x_q * inv_scale, with one scale per
    tensor (or per slice over `dims`, kept as size-1 dims: one per expert of a stacked weight)
    mapping the largest |x| onto the format's largest finite value (an all-zero tensor keeps scale
    1), or the given `scale` (values beyond its range saturate). Non-finite values stay
    non-finite, for the trainer's step guard to see."""
    top = torch.finfo(fp8).max
    if scale is None:
        scale = _scale_for(x.detach().abs().amax() if dims is None else x.detach().abs().amax(dim=dims, keepdim=True),
                           fp8)
    x_q = (x.detach().float() * scale).clamp(-top, top).to(fp8)
    return x_q, scale.reciprocal()


def _scale_for(amax: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The recipes' one rule: the scale mapping `amax` onto the format's largest finite value
    (1 where amax is 0, so an all-zero tensor or tile stays zero)."""
    amax = amax.float()
    return torch.where(amax > 0, torch.finfo(fp8).max / amax, torch.ones_like(amax))


class AmaxHistory:
    """execution.fp8_recipe=delayed, one operand role of one module: the largest |value| of the last
    `length` optimizer steps (slot 0: the step under way, the max over its micro-batches and any
    recomputed forward), and the scale frozen from them at the last step boundary. Until the first
    boundary the scale is the tensor's own (current scaling), so a fresh or resumed run never
    quantises with a made-up scale; after it, every call of a step uses the same frozen scale, so
    a recomputed forward quantises exactly as the first one did."""

    def __init__(self, fp8: torch.dtype, length: int):
        self.fp8, self.length = fp8, length
        self.amax: torch.Tensor | None = None  # [length] float32, on the operand's device
        self.scale: torch.Tensor | None = None

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        now = x.detach().abs().amax().float()
        if self.amax is None:
            self.amax = torch.zeros(self.length, device=x.device)
        self.amax[0] = torch.maximum(self.amax[0], now)
        # before the first boundary: this tensor's own scale, from the amax just taken
        return quantize(x, self.fp8, scale=self.scale if self.scale is not None else _scale_for(now, self.fp8))

    def advance(self, skipped: bool) -> None:
        """A step boundary: freeze the scale from the history and open a new slot; a skipped
        step (non-finite loss or gradients) leaves the scale and forgets its slot."""
        if self.amax is None:
            return
        if not skipped:
            self.scale = _scale_for(self.amax.amax(), self.fp8)
            self.amax = torch.roll(self.amax, 1)
        self.amax[0] = 0.0


def _check_widths(k: int, n: int, device: torch.device) -> None:
    if device.type == "cuda" and (k % _ALIGN or n % _ALIGN):
        raise ValueError(f"execution.fp8=torch: a GEMM of contraction {k} and width {n} is not FP8-able "
                         f"(cuBLAS needs multiples of {_ALIGN}); make the model's widths multiples of "
                         f"{_ALIGN} or set execution.fp8=none")


def scaled_mm(a_MK: torch.Tensor, inv_a: torch.Tensor, b_KN: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a * inv_a) @ (b * inv_b) of FP8 operands, float32 accumulation, in `out_dtype`. Takes any
    layouts: a is made row-major and b column-major, as cuBLAS wants them."""
    _check_widths(a_MK.shape[1], b_KN.shape[1], a_MK.device)
    if a_MK.shape[0] == 0:
        return a_MK.new_zeros(0, b_KN.shape[1], dtype=out_dtype)
    b_col = b_KN if b_KN.stride(0) == 1 else b_KN.t().contiguous().t()
    return torch._scaled_mm(a_MK.contiguous(), b_col, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    # _scaled_mm writes bf16, fp16 or fp32; float64 callers (tests) get float32 results, cast up.
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


# ---- The block recipe's operands and product ----

@dataclass
class Fp8Tiles:
    """An FP8 matrix with one float32 dequantisation factor per `tile` (rows x columns) of it:
    data ~ data_q * inv (each tile's factor). Tiles of (1, 128) and (128, 1) run along a GEMM's
    contraction; (128, 128) serve a weight both ways (forward and input gradient)."""

    data: torch.Tensor  # [R, C] FP8
    inv: torch.Tensor  # [R / tile[0], C / tile[1]] float32
    tile: tuple[int, int]

    def t(self) -> Fp8Tiles:
        return Fp8Tiles(self.data.t(), self.inv.t(), self.tile[::-1])

    def dequantize(self) -> torch.Tensor:
        inv = self.inv.repeat_interleave(self.tile[0], 0).repeat_interleave(self.tile[1], 1)
        return self.data.float() * inv


def quantize_tiles(x_RC: torch.Tensor, fp8: torch.dtype, tile: tuple[int, int]) -> Fp8Tiles:
    """x in `fp8` with one scale per tile (the rule of `quantize`, tile by tile): an outlier
    costs its own tile's precision, not the whole tensor's. R and C are multiples of the tile;
    leading dims (stacked experts) are quantised in the same ops."""
    top = torch.finfo(fp8).max
    (*lead, R, C), (tr, tc) = x_RC.shape, tile
    if R % tr or C % tc:  # e.g. an expert-tensor-parallel shard of the experts' hidden width
        raise ValueError(f"execution.fp8_recipe=block: a [{R}, {C}] operand does not split into {tr} x {tc} "
                         f"tiles; make every GEMM width (per ETP shard too) a multiple of {BLOCK}, or set "
                         "execution.fp8_recipe=tensor")
    blocks = x_RC.detach().float().reshape(*lead, R // tr, tr, C // tc, tc)
    scale = _scale_for(blocks.abs().amax(dim=(-3, -1)), fp8)
    q = (blocks * scale[..., :, None, :, None]).clamp(-top, top).to(fp8).reshape(x_RC.shape)
    return Fp8Tiles(q, scale.reciprocal(), tile)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of `multiple` (zeros add nothing to a sum)."""
    extra = -x.shape[0] % multiple
    return x if not extra else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def block_mm(a_MK: Fp8Tiles, b_KN: Fp8Tiles, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of tile-scaled operands, float32 accumulation. a's tiles run along K (1 x 128);
    b's are 128 x 128 or 128 x 1. On a GPU: torch's blockwise-scaled GEMM (cuBLAS, Hopper),
    with the operand and scale layouts it asks for; elsewhere the same sum from the dequantised
    operands in float32 (the reference the tests use)."""
    if a_MK.data.device.type == "cpu":
        return (a_MK.dequantize() @ b_KN.dequantize()).to(out_dtype)
    return _block_mm_gpu(a_MK, b_KN, out_dtype)


def _block_mm_gpu(a_MK: Fp8Tiles, b_KN: Fp8Tiles, out_dtype: torch.dtype) -> torch.Tensor:
    import torch.nn.functional as F

    kinds = {(1, BLOCK): F.ScalingType.BlockWise1x128, (BLOCK, 1): F.ScalingType.BlockWise1x128,
             (BLOCK, BLOCK): F.ScalingType.BlockWise128x128}
    M = a_MK.data.shape[0]
    # a: row-major data; its [M, K/128] scales "outer-dim major" (stride [1, M]); M padded to a
    # multiple of 16 (the scale columns stay 16-byte aligned; the padded rows are sliced off)
    a = _pad_to(a_MK.data, _ALIGN).contiguous()
    sa = _pad_to(a_MK.inv, _ALIGN).t().contiguous().t()
    b = b_KN.data.t().contiguous().t()  # column-major
    if b_KN.tile == (BLOCK, BLOCK):  # [K/128, N/128] with K/128 padded to a multiple of 4
        sb = _pad_to(b_KN.inv, 4).t().contiguous().t()
    else:  # (128, 1): [N, K/128], stride [1, N]
        sb = b_KN.inv.contiguous().t()
    y = F.scaled_mm(a, b, sa, kinds[a_MK.tile], sb, kinds[b_KN.tile], output_dtype=_out_dtype(out_dtype))
    return y[:M]


# ---- Recipes: how each of a linear layer's three products gets its FP8 operands ----

class TensorScaling:
    """Current per-tensor scaling (Transformer Engine's Float8CurrentScaling): one scale per
    activation, weight and gradient tensor (per expert for expert weights), taken from the
    tensor's own absolute maximum; quantised once, used in every product."""

    name = "tensor"

    def __init__(self, grouped: bool = False):
        self.grouped = grouped  # the experts' forward as one grouped call (Ops.fp8_grouped)

    def _quantize_act(self, x_MK):
        return quantize(x_MK, E4M3)

    def _quantize_grad(self, g_MN):
        return quantize(g_MN, E5M2)

    def weights(self, w_ENK):
        """Each group's weight with its own scale, all groups in the same ops."""
        q, inv = quantize(w_ENK, E4M3, dims=(1, 2))
        return list(zip(q.unbind(), inv.unbind(), strict=True))

    def act(self, x_MK, counts, given=None):
        """(operand of the forward product, pieces for the weight gradients). `given`: the
        forward operand quantised already (the block recipe's only)."""
        if given is not None:
            raise ValueError(f"execution.fp8_recipe={self.name} quantises each activation tensor whole; "
                             "a pre-quantised operand (the fp8 dispatch's) is the block recipe's")
        q = self._quantize_act(x_MK)
        return q, self.split(q, counts)

    def grad(self, g_MN, counts):
        """(operand of the input gradient, pieces for the weight gradients)."""
        q = self._quantize_grad(g_MN)
        return q, self.split(q, counts)

    def split(self, q, counts):
        return [(p, q[1]) for p in torch.split(q[0], counts)]

    def fprop(self, x, w, out_dtype):  # x @ w^T
        return scaled_mm(x[0], x[1], w[0].t(), w[1], out_dtype)

    def fprop_groups(self, x, ws, counts, out_dtype):
        """Every group's forward product [M, N]: one grouped GEMM where the run resolved torch's
        (`grouped`: fp8_grouped, E4M3 x E4M3 on Hopper) and these operands suit it, else a GEMM
        per group."""
        if self.grouped and fp8_grouped.usable(x[0], out_dtype, len(ws)):
            y = fp8_grouped.forward(x, ws, counts)
            if y is not None:
                return y
        return _each_group(self, x, ws, counts, out_dtype)

    def dgrad(self, g, w, out_dtype):  # g @ w
        return scaled_mm(g[0], g[1], w[0], w[1], out_dtype)

    def wgrad(self, g, x, out_dtype):  # g^T @ x over the rows, zero-padded to a multiple of 16
        return scaled_mm(_pad_to(g[0], _ALIGN).t(), g[1], _pad_to(x[0], _ALIGN), x[1], out_dtype)


class DelayedScaling(TensorScaling):
    """Transformer Engine's DelayedScaling (its HYBRID format, amax "max" over the history):
    activations and output gradients are scaled from the largest |value| of the last steps
    (AmaxHistory), not from their own, so quantising needs no reduction over the tensor first.
    Weights keep current scaling per tensor (per expert): the optimizer changes them every step,
    their amax is exact and cheap, and a lent expert (expert lending) brings no history along.
    One instance per module: it holds that module's histories, advanced by the trainer at every
    optimizer step (`advance`)."""

    name = "delayed"

    def __init__(self, length: int, grouped: bool = False):
        super().__init__(grouped)
        self.x, self.g = AmaxHistory(E4M3, length), AmaxHistory(E5M2, length)

    def _quantize_act(self, x_MK):
        return self.x.quantize(x_MK)

    def _quantize_grad(self, g_MN):
        return self.g.quantize(g_MN)

    def advance(self, skipped: bool = False) -> None:
        self.x.advance(skipped)
        self.g.advance(skipped)


class BlockScaling:
    """Per-block scaling (DeepSeek-V3's recipe; Transformer Engine's Float8BlockScaling): the
    activations and gradients one scale per 1 x 128 run of the contraction, weights one per
    128 x 128 block (the same blocks serve the forward and the input gradient). A weight
    gradient contracts over tokens, so its two operands are quantised again along the tokens,
    from the high-precision tensors, 128 tokens a block (each expert's rows zero-padded to it)."""

    name = "block"

    def weights(self, w_ENK):
        q = quantize_tiles(w_ENK, E4M3, (BLOCK, BLOCK))
        return [Fp8Tiles(d, s, q.tile) for d, s in zip(q.data.unbind(), q.inv.unbind(), strict=True)]

    def act(self, x_MK, counts, given: Fp8Tiles | None = None):
        if given is None:
            given = quantize_tiles(x_MK, E4M3, (1, BLOCK))
        elif given.tile != (1, BLOCK) or given.data.shape != x_MK.shape or given.data.dtype != E4M3:
            raise ValueError(f"a pre-quantised activation must be E4M3 in 1 x {BLOCK} tiles of shape "
                             f"{tuple(x_MK.shape)}, got {given.data.dtype} {given.tile} {tuple(given.data.shape)}")
        return given, [quantize_tiles(_pad_to(p, BLOCK), E4M3, (BLOCK, 1)) for p in torch.split(x_MK, counts)]

    def grad(self, g_MN, counts):
        return (quantize_tiles(g_MN, E5M2, (1, BLOCK)),
                [quantize_tiles(_pad_to(p, BLOCK), E5M2, (BLOCK, 1)) for p in torch.split(g_MN, counts)])

    def split(self, q: Fp8Tiles, counts):
        return [Fp8Tiles(d, s, q.tile) for d, s in
                zip(torch.split(q.data, counts), torch.split(q.inv, counts), strict=True)]

    def fprop(self, x, w, out_dtype):
        return block_mm(x, w.t(), out_dtype)

    def fprop_groups(self, x, ws, counts, out_dtype):
        return _each_group(self, x, ws, counts, out_dtype)

    def dgrad(self, g, w, out_dtype):
        return block_mm(g, w, out_dtype)

    def wgrad(self, g, x, out_dtype):
        return block_mm(g.t(), x, out_dtype)


RECIPES = {"tensor": TensorScaling(), "block": BlockScaling()}  # stateless: one instance serves all
RECIPE_CHOICES = ("tensor", "block", "delayed")


def make_recipe(name: str, history: int = 16, grouped: bool = False):
    """The scaling object a module runs `execution.fp8_recipe=name` with (its own for delayed).
    `grouped` (Ops.fp8_grouped, resolved for the run's device): the per-tensor recipes run the
    experts' forward as one grouped GEMM; the block recipe has none (it loops either way)."""
    check_choice("execution.fp8_recipe", name, RECIPE_CHOICES)
    if name == "delayed":
        return DelayedScaling(history, grouped)
    return TensorScaling(grouped) if name == "tensor" and grouped else RECIPES[name]


def _flat(objs) -> tuple[list[torch.Tensor], list]:
    """Quantised operands as plain tensors for save_for_backward (so saved-tensor hooks, e.g.
    activation checkpointing, see them), and how to rebuild them."""
    tensors, kinds = [], []
    for o in objs:
        if isinstance(o, Fp8Tiles):
            tensors += [o.data, o.inv]
            kinds.append(o.tile)
        else:
            tensors += list(o)
            kinds.append(None)
    return tensors, kinds


def _unflat(tensors, kinds) -> list:
    out = []
    for i, tile in enumerate(kinds):
        d, s = tensors[2 * i], tensors[2 * i + 1]
        out.append((d, s) if tile is None else Fp8Tiles(d, s, tile))
    return out


def _weight_grad(recipe, g, x, n: int, k: int, device) -> torch.Tensor:
    """g^T x [N, K] in float32 over one piece's rows (zeros for an expert without rows)."""
    rows = x.data.shape[0] if isinstance(x, Fp8Tiles) else x[0].shape[0]
    if rows == 0:
        return torch.zeros(n, k, dtype=torch.float32, device=device)
    return recipe.wgrad(g, x, torch.float32)


def _each_group(recipe, x, ws, counts, out_dtype) -> torch.Tensor:
    """The forward product group by group: one GEMM per group with its own weight."""
    return torch.cat([recipe.fprop(p, ws[e], out_dtype) for e, p in enumerate(recipe.split(x, counts))])


class _Fp8Grouped(torch.autograd.Function):
    """y_MN: rows sorted by group, counts rows each, y[rows of e] = x[rows of e] @ w_ENK[e]^T,
    in FP8 by `recipe` with one weight (and its own scales) per group, as in TE's GroupedLinear.
    A plain linear layer is one group. One GEMM per group with rows (the forward's as one
    grouped GEMM where fp8_grouped can)."""

    @staticmethod
    def forward(ctx, x_MK, w_ENK, counts, cdtype, recipe, b_N, x_given):
        x_fwd, x_w = recipe.act(x_MK, counts, x_given)
        ws = recipe.weights(w_ENK)
        out = _out_dtype(cdtype)
        y_MN = recipe.fprop_groups(x_fwd, ws, counts, out).to(cdtype)
        if b_N is not None:
            y_MN = y_MN + b_N.to(cdtype)
        tensors, ctx.kinds = _flat([*ws, *x_w])
        ctx.save_for_backward(*tensors)
        ctx.counts, ctx.recipe = counts, recipe
        ctx.dtypes = (x_MK.dtype, w_ENK.dtype, None if b_N is None else b_N.dtype)
        ctx.nk = w_ENK.shape[1:]
        return y_MN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_MN):
        recipe, counts, (n, k) = ctx.recipe, ctx.counts, ctx.nk
        saved = _unflat(ctx.saved_tensors, ctx.kinds)
        ws, x_w = saved[:len(counts)], saved[len(counts):]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g_d, g_w = recipe.grad(g_MN, counts)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            out = _out_dtype(x_dtype)
            dx = torch.cat([recipe.dgrad(g, ws[e], out)
                            for e, g in enumerate(recipe.split(g_d, counts))]).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.stack([_weight_grad(recipe, g, x, n, k, g_MN.device)
                              for g, x in zip(g_w, x_w, strict=True)]).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[5]:
            db = g_MN.float().sum(0).to(b_dtype)
        return dx, dw, None, None, None, db, None


def _recipe(recipe):
    """A recipe object, or the name of a stateless one."""
    return make_recipe(recipe) if isinstance(recipe, str) else recipe


def linear(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, cdtype: torch.dtype,
           recipe="tensor") -> torch.Tensor:
    """F.linear in FP8 over the last dim of x (any leading dims); the result in `cdtype`.
    `recipe`: a recipe's name, or its object (make_recipe; delayed scaling's holds state)."""
    x_MK = x.reshape(-1, x.shape[-1])
    y_MN = _Fp8Grouped.apply(x_MK, w_NK.unsqueeze(0), [x_MK.shape[0]], cdtype, _recipe(recipe), b_N, None)
    return y_MN.view(*x.shape[:-1], w_NK.shape[0])


def grouped_matmul(x_MD: torch.Tensor, w_EDF: torch.Tensor, rows: list[int], cdtype: torch.dtype,
                   recipe="tensor", x_fp8: Fp8Tiles | None = None) -> torch.Tensor:
    """The experts' grouped GEMM in FP8 (execution.grouped_gemm's contract, result in `cdtype`).
    `rows`: the rows per expert as host ints, which the GEMMs loop by (the dispatchers know them
    from the routing counts they read once per layer; read here from the device they would cost
    a GPU sync per GEMM). `x_fp8`: x's FP8 form already made (the block recipe's 1 x 128 tiles,
    e.g. the fp8 dispatch's payload), used as the forward operand instead of quantising x again;
    the weight gradient still quantises x along the tokens itself."""
    if isinstance(rows, torch.Tensor):
        raise TypeError("fp8.grouped_matmul takes the rows per expert as host ints (a list), not a tensor: "
                        "reading device counts back here syncs a GPU at every GEMM; pass counts.tolist() "
                        "once per layer")
    return _Fp8Grouped.apply(x_MD, w_EDF.transpose(1, 2), list(rows), cdtype, _recipe(recipe), None, x_fp8)


__all__ = ["BLOCK", "E4M3", "E5M2", "FP8_CHOICES", "RECIPES", "RECIPE_CHOICES", "AmaxHistory", "DelayedScaling",
           "Fp8Tiles", "block_mm", "grouped_matmul", "linear", "make_recipe", "quantize", "quantize_tiles",
           "scaled_mm", "unavailable_reason"]
