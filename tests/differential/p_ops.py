"""Operators whose backward or layout is easy to get subtly wrong: ties in reductions, zeros in
products, padding modes, resampling, normalizations with running statistics, losses, linear
algebra, random reparameterisation, distributions."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .programs import fn, program, r

O = "ops"


def _ties(n):
    """A tensor with repeated values (ties in max/median/sort)."""
    return torch.tensor([[1.0, 3.0, 3.0, 2.0]] * n).requires_grad_()


@program("max_min_full_reduction_ties", O, must_match=True)
def _(n=3):
    return fn(lambda x: x.max() + 2 * x.min() + x.amax(1).sum() + x.max(1).values.sum(), _ties(n))


@program("median_kthvalue_mode_ties", O, must_match=True)
def _(n=3):
    return fn(lambda x: x.median() + x.median(1).values.sum() + x.kthvalue(2, 1).values.sum()
              + x.mode(1).values.sum() + x.nanmedian(), _ties(n))


@program("sort_topk_ties", O, must_match=True)
def _(n=3):
    return fn(lambda x: (x.sort(dim=1, stable=True).values * torch.arange(4.0)).sum()
              + x.topk(2, 1).values.sum() + x.argsort(1).float().sum(), _ties(n))


@program("cumprod_with_zeros", O, must_match=True)
def _(n=3):
    x = torch.tensor([[2.0, 0.0, 3.0, 0.0, 1.5]] * n).requires_grad_()
    return fn(lambda x: x.cumprod(1).sum() + x.prod(1).sum() + x.logcumsumexp(1).sum() + x.cummax(1).values.sum(), x)


@program("norms_at_zero", O, must_match=True)
def _(n=3):
    x = torch.zeros(n, 4).requires_grad_()
    return fn(lambda x, y: x.norm() + (x + y).norm(dim=1).sum() + torch.linalg.vector_norm(x, ord=float("inf"))
              + F.normalize(x + y, dim=1).sum(), x, r(n, 4))


@program("pad_modes", O, must_match=True)
def _(n=2):
    return fn(lambda x: sum((F.pad(x, (2, 1, 1, 2), mode=m) ** 2).sum() for m in ("reflect", "replicate", "circular"))
              + F.pad(x, (1, 1), value=0.5).sum(), r(n, 3, 5, 6, rg=True))


@program("interpolate_modes", O, must_match=True)
def _(n=2):
    def f(x):
        out = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True).square().sum()
        out = out + F.interpolate(x, size=(7, 5), mode="nearest").square().sum()
        out = out + F.interpolate(x, scale_factor=1.5, mode="bicubic").square().sum()
        return out + F.pixel_shuffle(torch.cat([x] * 4, 1), 2).square().sum() + F.pixel_unshuffle(x[..., :4, :4], 2).sum()
    return fn(f, r(n, 3, 4, 6, rg=True))


@program("group_instance_norms", O, must_match=True, calls=2)
def _(n=2):
    m = nn.Sequential(nn.Conv2d(4, 6, 3), nn.GroupNorm(3, 6), nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
                      nn.LocalResponseNorm(2), nn.GELU(approximate="tanh"))
    return fn(m, r(n, 4, 6, 6))


@program("instance_norm_eval_running_stats", O, must_match=True)
def _(n=2):
    m = nn.InstanceNorm1d(3, track_running_stats=True)
    m.running_mean.add_(0.5)
    return fn(m.eval(), r(n, 3, 5, rg=True))


@program("losses", O, must_match=True)
def _(n=4):
    def f(x, y, t):
        return (F.smooth_l1_loss(x, y, beta=0.5) + F.huber_loss(x, y) + F.kl_div(x.log_softmax(1), y.softmax(1), reduction="batchmean")
                + F.binary_cross_entropy_with_logits(x, y.sigmoid(), pos_weight=torch.ones(5) * 2)
                + F.cross_entropy(x, t, label_smoothing=0.1, ignore_index=2) + F.multi_margin_loss(x, t)
                + F.cosine_embedding_loss(x, y, torch.ones(x.shape[0])) + F.poisson_nll_loss(x, y.abs()))
    return fn(f, r(n, 5, rg=True), r(n, 5), torch.tensor([0, 2, 4, 1] * (n // 4) + [3] * (n % 4)))


@program("ctc_loss_lengths_as_lists", O, tol=(1e-5, 1e-5))
def _(n=2):
    # Refused as data-dependent: fake tensors' _ctc_loss does not size its outputs from the lengths.
    def f(x, targets):
        return F.ctc_loss(x.log_softmax(2), targets, [8] * n, [3] * n)
    return fn(f, r(8, n, 5, rg=True), torch.randint(1, 5, (n, 3)))


@program("ctc_loss_lengths_as_tensors", O, tol=(1e-5, 1e-5))
def _(n=2):
    # The kernel reads the lengths' values: refused as data-dependent (Dynamo runs it eagerly).
    def f(x, targets, lengths):
        return F.ctc_loss(x.log_softmax(2), targets, lengths, torch.full((n,), 3, dtype=torch.long))
    return fn(f, r(8, n, 5, rg=True), torch.randint(1, 5, (n, 3)), torch.full((n,), 8, dtype=torch.long))


@program("linalg_grads", O, must_match=True, tol=(1e-4, 1e-5))
def _(n=3):
    def f(a, b):
        spd = a @ a.mT + torch.eye(n)
        return (torch.linalg.solve(spd, b).sum() + torch.linalg.cholesky(spd).sum() + torch.linalg.slogdet(spd)[1]
                + torch.linalg.eigh(spd)[0].sum() + torch.linalg.svdvals(a).sum() + torch.linalg.inv(spd).trace()
                + torch.linalg.qr(a)[1].diagonal().abs().sum())
    return fn(f, r(n, n, rg=True), r(n, 2, rg=True))


@program("einsum_diagonal_and_products", O, must_match=True)
def _(n=3):
    return fn(lambda a, b: torch.einsum("ii->i", a).sum() + torch.einsum("ij,jk->ik", a, b).sum()
              + torch.einsum("bi,bi->b", a, a).sum() + torch.cdist(a, b.mT).sum() + torch.linalg.cross(a, a.flip(0)).sum(),
              r(n, n, rg=True), r(n, 4, rg=True))


@program("shape_shuffles", O, must_match=True)
def _(n=3):
    def f(x):
        y = torch.roll(x, 1, 0) + torch.rot90(x, 1, (0, 1)).mT + x.tril(-1) + x.triu(1) + torch.diff(x, dim=1, prepend=x[:, :1])
        return torch.block_diag(y, x[:2, :2]).sum() + F.unfold(y[None, None], 2).sum() + y.flip(1).cumsum(0).sum()
    return fn(f, r(n, n, rg=True))


@program("scatter_index_reductions", O, must_match=True)
def _(n=4):
    def f(x, src):
        idx = torch.tensor([0, 1, 1, 3])[:n].clamp(max=n - 1)
        a = x.index_add(0, idx, src) + x.index_put((idx,), src, accumulate=True)
        b = x.scatter_reduce(0, idx[:, None].expand_as(src), src, "amax", include_self=False)
        c = x.index_reduce(0, idx, src, "prod", include_self=True)
        return (a * b).sum() + c.sum() + x.scatter_add(0, idx[:, None].expand_as(src), src).square().sum()
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("masking_and_nan_to_num", O, must_match=True)
def _(n=4):
    def f(x):
        y = torch.where(x > 0, x.sqrt(), torch.zeros_like(x))
        z = torch.nan_to_num(x.log(), nan=0.0, neginf=-5.0)
        return (y + z).sum() + x.clamp(min=torch.zeros_like(x), max=torch.ones_like(x)).sum() \
            + torch.lerp(x, x.flip(0), 0.3).sum() + torch.addcdiv(x, x, x.abs() + 1, value=0.5).sum()
    return fn(f, r(n, 3, rg=True))


@program("gumbel_softmax_hard", O, must_match=True)
def _(n=4):
    return fn(lambda x: (F.gumbel_softmax(x, tau=0.5, hard=True) * torch.arange(5.0)).sum(), r(n, 5, rg=True))


@program("random_activations", O, must_match=True)
def _(n=4):
    return fn(lambda x: (F.rrelu(x, training=True) + F.dropout1d(x[None], 0.3)[0] + F.alpha_dropout(x, 0.2, True)
                         + F.feature_alpha_dropout(x[..., None], 0.2, True)[..., 0]).sum(), r(n, 6, rg=True))


@program("random_draws_nothing_reads", O, must_match=True)
def _(n=4):
    """Dropout and ``rand`` whose results are discarded still advance eager's stream (Inductor drops
    what no output needs)."""
    def f(x):
        F.dropout(x, 0.5)
        torch.rand(3)
        return (x * 2).sum()
    return fn(f, r(n, 6, rg=True))


@program("normal_rsample_reparameterised", O, must_match=True)
def _(n=4):
    def f(mu, log_sigma):
        q = torch.distributions.Normal(mu, log_sigma.exp(), validate_args=False)
        z = q.rsample()
        p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu), validate_args=False)
        return (z.square().sum() + torch.distributions.kl_divergence(q, p).sum() + q.log_prob(z).sum())
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("distribution_validating_arguments", O)
def _(n=4):
    def f(mu, log_sigma):
        # Explicit: the default is on, but Dynamo turns it off for the whole process when it first runs.
        q = torch.distributions.Normal(mu, log_sigma.exp(), validate_args=True)     # checks scale > 0
        return q.rsample().square().sum() + q.entropy().sum()
    return fn(f, r(n, 3, rg=True), r(n, 3, rg=True))


@program("categorical_sample_log_prob", O)
def _(n=4):
    def f(logits):
        d = torch.distributions.Categorical(logits=logits, validate_args=False)
        a = d.sample()
        return (d.log_prob(a) * 2).sum() + d.entropy().sum()
    return fn(f, r(n, 5, rg=True))


class _Attention(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.0)
        self.padding = torch.zeros(n, 5, dtype=torch.bool)      # plain attributes: constants
        self.padding[:, -1] = True
        self.causal = nn.Transformer.generate_square_subsequent_mask(5)

    def forward(self, x):
        y = self.mha(x, x, x, key_padding_mask=self.padding, attn_mask=self.causal, need_weights=True,
                     average_attn_weights=False)[0]
        return y.sum() + self.mha(x, x, x, need_weights=False)[0].sum()


@program("multihead_attention_masks", O, must_match=True)
def _(n=2):
    return fn(_Attention(n), r(n, 5, 8, rg=True))


@program("transformer_encoder_norm_first", O, must_match=True)
def _(n=2):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True, activation="gelu")
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return fn(m, r(n, 5, 8, rg=True))


@program("integer_arithmetic_indices", O, must_match=True)
def _(n=4):
    def f(x, k):
        i = (k * 3 - 7) % n
        j = torch.div(k, 2, rounding_mode="floor").clamp(0, 2)
        b = torch.bucketize(x.detach()[:, 0], torch.tensor([-1.0, 0.0, 1.0]))
        return x[i, j].sum() + (x.gather(1, j[:, None]) * b[:, None]).sum() + (k.bitwise_xor(3) & 1).float().sum()
    return fn(f, r(n, 3, rg=True), torch.arange(n))


@program("fft_roundtrip_loss", O, must_match=True, tol=(1e-5, 1e-5))
def _(n=4):
    def f(x):
        s = torch.fft.rfft(x, dim=1)
        return (s.abs() ** 2).sum() + torch.fft.irfft(s * 0.5, n=x.shape[1], dim=1).sum() + torch.view_as_real(s).square().sum()
    return fn(f, r(n, 8, rg=True))


@program("weight_clipped_in_forward", O, must_match=True, calls=3)
def _(n=4):
    class Clipped(nn.Module):      # WGAN-style: the critic's weights clamped in place before use
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                self.lin.weight.clamp_(-0.2, 0.2)
            return self.lin(x).tanh()
    return fn(Clipped(), r(n, 3))


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0, scale_grad_by_freq=True)
        self.bag = nn.EmbeddingBag(7, 4, mode="max")

    def forward(self, i):
        return (self.emb(i) * 2).sum() + self.bag(i).square().sum()


@program("embedding_padding_idx_freq", O, must_match=True)
def _(n=6):
    return fn(_Embeddings(), torch.tensor([[0, 2, 2, 5], [1, 0, 2, 6]] * (n // 2)))


# Tensors the program holds as constants (a closure's, a plain attribute's): an op of constants alone
# makes a traced value, which the program may write; a view of a constant is the constant's.
_MASK = torch.tensor([[False, False, True, False]] * 8)
_TABLE = torch.arange(8.0)


@program("fresh_tensor_from_a_constant_written", O, must_match=True)
def _(n=4):
    def f(x):
        m = torch.zeros_like(_MASK[:n], dtype=x.dtype).masked_fill_(_MASK[:n], float("-inf"))
        e = torch.empty_like(_TABLE[:4]).copy_(x[0])
        o = torch.ones_like(_TABLE[:4])
        o.mul_(x[1])
        return (x + m).softmax(1).sum() + (e * o).sum()
    return fn(f, r(n, 4, rg=True))


@program("constant_view_written", O)
def _(n=4):
    table = torch.zeros(8)
    def f(x):
        table.view(2, 4)[0].add_(1)     # writes the constant itself: eager's table changes every call
        return x * table[:4]
    return fn(f, r(n, 4, rg=True))
