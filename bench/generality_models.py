"""Factory models of the generality accuracy set (bench/generality_cases.py)."""
import torch
import torch.nn.functional as F


class SmallCNN(torch.nn.Module):
    """A plain image classifier: conv stages with batch norm, pooled logits. forward(x) takes the
    images only: the labels in the batch are for the loss function."""

    def __init__(self, classes: int = 100, width: int = 64):
        super().__init__()
        chans = [3, width, 2 * width, 4 * width, 8 * width]
        layers = []
        for cin, cout in zip(chans, chans[1:]):
            layers += [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                       torch.nn.Conv2d(cout, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                       torch.nn.MaxPool2d(2)]
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(chans[-1], classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def cnn(spec):
    """SmallCNN on {"x": images, "y": labels}; loss = cross_entropy(logits, y)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision, torch.float32)
    model = SmallCNN().to(dtype)
    S = spec.image_size or 128
    batch = {"x": torch.randn(spec.batch_size, 3, S, S, dtype=dtype), "y": torch.randint(0, 100, (spec.batch_size,))}
    return model, batch, lambda out, b: F.cross_entropy(out, b["y"])
