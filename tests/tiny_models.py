"""Tiny factory models for tests (`--model tests.tiny_models:linear`)."""
import torch


def linear(spec=None):
    """One bias-free 1024x1024 linear layer; batch of 16 (or the spec's) x 1024 fp32; loss = sum of outputs."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False))
    batch = 16 if spec is None or spec.batch_size == 1 else spec.batch_size
    x = torch.randn(batch, 1024)
    return model, x, lambda out, batch: out.sum()


def mlp(spec=None):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(4, 64)
    return model, x


def seq_linear(spec=None):
    """A bias-free 64x32 linear layer over sequences: batch of 8 (or the spec's) x 16 (or --seq-len)
    tokens x 64 fp32; one loss per sample (the sum of its outputs), as Opacus' ghost clipping needs."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    batch = 8 if spec is None or spec.batch_size == 1 else spec.batch_size
    x = torch.randn(batch, (spec.seq_len if spec is not None and spec.seq_len else 16), 64)
    return model, x, lambda out, batch: out.sum(dim=(1, 2))


def linear_norm(spec=None):
    """A 1024x1024 linear layer with a bias, then a LayerNorm: the Trainer's decay group is the
    weight alone, its no-decay group the bias and the norm's weight and bias."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024))
    return model, torch.randn(16, 1024), lambda out, batch: out.sum()


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(1024, 1024, bias=False)

    def forward(self, x):
        return self.fc(x)


def labelled(spec=None):
    """forward(x) and a batch that also carries the labels its loss function reads."""
    import torch.nn.functional as F

    batch = {"x": torch.randn(16, 1024), "y": torch.randint(0, 1024, (16,))}
    return _Classifier(), batch, lambda out, b: F.cross_entropy(out, b["y"])


def labelled_no_loss(spec=None):
    return _Classifier(), {"x": torch.randn(16, 1024), "y": torch.randint(0, 1024, (16,))}


def unmatched(spec=None):
    return _Classifier(), {"images": torch.randn(16, 1024)}, lambda out, b: out.sum()


def own_step(spec=None):
    """A factory that returns its own step(model, batch) -> loss."""
    import torch.nn.functional as F

    def step(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    return _Classifier(), {"x": torch.randn(16, 1024), "y": torch.randint(0, 1024, (16,))}, step


def no_spec():
    """A factory that takes no spec (so it cannot apply spec settings itself)."""
    return labelled()


class _MHA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def mha(spec=None):
    """nn.MultiheadAttention (as torchvision's ViT uses it) on a 2 x 32 x 64 batch."""
    return _MHA(), torch.randn(2, 32, 64), lambda out, batch: out.sum()


class _ManyOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        for _ in range(1100):   # a Python loop of its own ops (what a sequential scan fallback does)
            x = x * 1.0001
        return self.fc(x)


def many_ops(spec=None):
    """A module running 1100 ops of its own in one forward (refused eager, one graph compiled)."""
    return _ManyOps(), {"x": torch.randn(spec.batch_size if spec else 4, 64)}, lambda out, b: out.sum()


class _LayerDrop(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc = torch.nn.Linear(1024, 1024, bias=False)
        self.p = p

    def forward(self, x):
        if self.training and torch.rand([]) < self.p:   # LayerDrop's host coin (transformers' BART up to 5.17)
            return x
        return self.fc(x)


def layerdrop(spec=None):
    """A layer skipped when a host draw falls under p = 0.0 (never): the branch reads the draw's value."""
    return _LayerDrop(0.0), {"x": torch.randn(16, 1024)}, lambda out, b: out.sum()


def no_layerdrop(spec=None):
    return _Classifier(), {"x": torch.randn(16, 1024)}, lambda out, b: out.sum()


class _PooledCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(16 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x).relu()).flatten(1))


def pooled_cnn(spec=None):
    """A convolution, max-pooling and a classifier (inductor decomposes max-pool)."""
    import torch.nn.functional as F

    batch = {"x": torch.randn(8, 3, 32, 32), "y": torch.randint(0, 10, (8,))}
    return _PooledCNN(), batch, lambda out, b: F.cross_entropy(out, b["y"])


class _TwiceOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        y = self.fc(x)
        return {"a": y, "b": y, "c": y * 2}    # the same tensor under two keys


def twice_out(spec=None):
    return _TwiceOut(), {"x": torch.randn(8, 64)}, lambda out, b: out["a"].sum() + out["b"].sum() + out["c"].sum()


class _ColumnMajorGrad(torch.autograd.Function):
    """Identity whose backward returns the gradient in column-major layout."""

    @staticmethod
    def forward(ctx, w):
        return w * 1

    @staticmethod
    def backward(ctx, g):
        return g.t().contiguous().t()


class _CopiedGrad(torch.nn.Module):
    """A weight whose gradient arrives in another layout (strides not the parameter's): its
    gradient accumulator copies it instead of stealing it (torch's layout contract)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 64))

    def forward(self, x):
        return torch.nn.functional.linear(x, _ColumnMajorGrad.apply(self.w))


def copied_grad(spec=None):
    return _CopiedGrad(), torch.randn(16, 64), lambda out, batch: out.sum()


def hidden_linear(spec=None):
    """A bias-free 64x32 linear layer fed a hidden state: an input that requires grad and that the
    step holds anyway (as inside a network); batch of 8 (or the spec's) x 16 (or --seq-len) x 64 fp32;
    step: the sum of the outputs."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    batch = 8 if spec is None or spec.batch_size == 1 else spec.batch_size
    x = torch.randn(batch, (spec.seq_len if spec is not None and spec.seq_len else 16), 64)

    def step(model, batch):
        hidden = batch.detach().requires_grad_()
        return model(hidden).sum()

    return model, x, step


class _Block(torch.nn.Module):
    """Linear(64 -> 256), GELU, Linear(256 -> 64), no biases: in training it saves its input x (for the first
    weight's gradient), the GELU's input a and output g (16 x 256 fp32 each: 16 KiB)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256, bias=False)
        self.down = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _Blocks(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def blocks(spec=None):
    """Four _Blocks in a ModuleList (``blocks``); a batch of 16 (or the spec's) x 64 fp32; loss = sum of the outputs."""
    batch = 16 if spec is None or spec.batch_size == 1 else spec.batch_size
    return _Blocks(4), torch.randn(batch, 64), lambda out, batch: out.sum()


class _Tied(torch.nn.Module):
    """A 1024-token embedding whose weight is also the output projection (tied, as lm_head and embed_tokens)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 1024)

    def forward(self, ids):
        return torch.tanh(self.emb(ids)) @ self.emb.weight.t()


def tied(spec=None):
    """Tied embedding and head, 1024 x 1024 fp32 (4 MiB); 16 token ids; loss = sum of the logits."""
    return _Tied(), torch.randint(0, 1024, (16,)), lambda out, batch: out.sum()


def hooked_linear(spec=None):
    """:func:`linear` with a user's own full backward hook on its layer (not Opacus')."""
    model, x, loss = linear(spec)
    model[0].register_full_backward_hook(lambda mod, grad_in, grad_out: None)
    return model, x, loss


class _Twice(torch.nn.Module):
    """``h = fc(x)``, then ``h * 2 + h.tanh()``: h's gradient is the sum of two, made by two nodes."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(1024, 1024, bias=False)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 + h.tanh()


def twice(spec=None):
    """:class:`_Twice` over 16 x 1024 fp32 (64 KiB activations); loss = sum of the outputs."""
    return _Twice(), torch.randn(16, 1024), lambda out, batch: out.sum()


def biased_tokens(spec=None):
    """A 64 -> 1024 linear layer with a bias over batch (2, or the spec's) x 512 tokens fp32: the bias gradient sums
    1,024 token rows per output (a long column reduction); loss = sum of the squared outputs (a dense gradient)."""
    batch = 2 if spec is None or spec.batch_size == 1 else spec.batch_size
    return (torch.nn.Sequential(torch.nn.Linear(64, 1024)), torch.randn(batch, 512, 64),
            lambda out, batch: out.pow(2).sum())


class _PatchEmbed(torch.nn.Module):
    """ViT's patch embedding: a 4x4 stride-4 convolution with a bias, flattened and transposed to (B, patches, C), then
    made contiguous (as ViT's concatenation with the class token does)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 64, 4, stride=4)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


def patch_embed(spec=None):
    """:class:`_PatchEmbed` over 32 images of 64 x 64 fp32 (256 patches each); loss = sum of the squared outputs."""
    return _PatchEmbed(), torch.randn(32, 3, 64, 64), lambda out, batch: out.pow(2).sum()
