"""An Accelerate training script that knows nothing of numguard (it never imports it).

A two-layer nn.TransformerEncoder with PyTorch's causal mask, trained through
Accelerator(cpu=True).prepare(model, optimizer, data) and accelerator.backward with AdamW. At step
--overflow-at the second layer's feed-forward output is scaled to Inf.

    python unmodified_accelerate.py [--steps N] [--overflow-at K] [--mixed-precision no|bf16]

Prints "step N loss X" per step and "finished N steps" at the end (exit status 0).
"""
import argparse

import torch
from accelerate import Accelerator
from torch import nn

SEQ, WIDTH = 6, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 1)
        self.mask = nn.Transformer.generate_square_subsequent_mask(SEQ)

    def forward(self, x):
        return self.head(self.encoder(x, mask=self.mask, is_causal=True)).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--overflow-at", type=int, default=-1)
    parser.add_argument("--mixed-precision", default="no")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(torch.randn(4 * args.steps, SEQ, WIDTH), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    overflowing = accelerator.unwrap_model(model).encoder.layers[1].linear2
    overflowing.register_forward_hook(lambda mod, inp, out: out * float("inf") if mod.overflow else None)
    for step, batch in enumerate(data):
        overflowing.overflow = step == args.overflow_at
        loss = model(batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    print(f"finished {args.steps} steps")


if __name__ == "__main__":
    main()
