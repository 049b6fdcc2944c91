"""numguard's demo: train a small transformer in fp16 on the CPU until a layer overflows, and show
where the numbers went wrong.

    python -m numguard.demo [--steps 12] [--seed 0]

A random-init GPT-2 (built from a config: nothing is downloaded) trains on random tokens in
float16 with every module watched by `numguard.watch`. One MLP layer is made to diverge (its
weight doubles at every step, as a layer does when its learning rate is too high): numguard
first warns that the layer's activations are approaching float16's limit (65504), then, when the
layer overflows, prints the frames that led to the first inf and stops training with
`numguard.NonFiniteError`. Last, `Inspector.advice()` reads numguard's per-module history of the
batches before the trip and says which modules will overflow float16 first.
"""
from __future__ import annotations

import argparse
import time
import warnings


def build_model(seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(torch.float16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numguard.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps at most (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=12, help="frames shown in the report (default 12)")
    parser.add_argument("--advice-rows", type=int, default=6, help="modules shown in the advice (default 6)")
    args = parser.parse_args(argv)

    import torch

    import numguard
    from numguard.errors import HeadroomWarning

    torch.set_num_threads(1)
    started = time.perf_counter()
    model = build_model(args.seed)
    diverging = model.transformer.h[1].mlp.c_fc
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(args.seed))
    print(f"numguard demo: GPT-2 with {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
          f"float16, CPU, numguard backend: {numguard.backend()}")
    print(f"transformer.h.1.mlp.c_fc diverges: its weight doubles at every step\n")

    def show_warning(message, category, filename, lineno, file=None, line=None):
        tag = "headroom warning" if issubclass(category, HeadroomWarning) else category.__name__
        print(f"  [{tag}] {message}")

    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        warnings.simplefilter("always", HeadroomWarning)
        try:
            insp = numguard.watch(model, max_frames_to_save=args.frames)
            with insp:
                for step in range(args.steps):
                    loss = model(tokens, labels=tokens).loss
                    loss.backward()
                    # Like GradScaler, skip a step whose gradients overflowed (the weights stay finite).
                    if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None):
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        diverging.weight.mul_(2)
                    print(f"step {step:2d}  loss {loss.item():8.4f}")
        except numguard.NonFiniteError as err:
            print(f"numguard stopped training at batch_number={err.batch_number}: first non-finite value in "
                  f"{err.module!r}, {', '.join(err.labels)}")
            print("\nWhat to do about it (numguard's precision advice from the batches before the trip):")
            from numguard.advice import render
            print(render(insp.advice(), limit=args.advice_rows))
            print(f"(demo finished in {time.perf_counter() - started:.1f} s)")
            return 0
    print("no overflow within the steps given; try more --steps")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
