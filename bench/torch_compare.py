"""Real execution on 2 CPU ranks: dipc against torch.distributed.pipelining on the same imbalanced VLM.

    python bench/torch_compare.py [--steps 6] [--microbatches 4] [--out docs/bench_torch_compare.md]

One vision-heavy reference VLM (dipc.models.ReferenceVLM: a 6-layer 128-wide ViT on 32 px images, 16 patches
each, and a 4-layer 128-wide language model), one set of generated batches (``dipc.models.data.vlm_batches``:
the paper's packing statistics scaled to the model, 0-48 images per sequence), run four ways for ``--steps`` timed
steps each (forward + backward; the gradients are cleared between steps):

* unsplit: the whole model in one process (2 threads, so it uses the machine's 2 cores like the pipelines);
* torch ``Schedule1F1B`` on 2 stages and ``ScheduleInterleaved1F1B`` on 4 (2 per rank), gloo, one thread per rank:
  torch pipelines need one shape for every microbatch, so each batch is padded the way a torch user pads it -
  every sample to the batch's largest image count (zero images whose features are dropped before the merge) and
  every batch to one sequence length; stage 0 holds the vision tower, the projector, the embedding and the first
  text layers (the split by parameter-free layer count a torch user would write: the vision tower cannot be cut
  from the text it feeds without passing both through every stage);
* dipc (``schedule="dip"``, the default) on the unpadded batches, and on the padded ones; and dipc with the
  ``1f1b`` template on the unpadded batches.

Reported: median step time per way, and for the torch runs their loss (torch averages the per-microbatch mean
losses; dipc and the unsplit model give the batch's token mean - the table says which equals the unsplit model).
Tiny models on a shared 2-core CPU: compare ratios within one run, not across runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def make_config():
    from dipc.models import VLMConfig
    from dipc.models.language import TextConfig
    from dipc.models.vlm import VisionConfig
    cfg = VLMConfig.tiny()
    cfg.vision = VisionConfig(image_size=32, patch_size=8, dim=128, n_layers=6, n_heads=4, ffn_dim=512)
    cfg.text = TextConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384)
    return cfg


def make_model(seed=0):
    from dipc.models import ReferenceVLM
    torch.manual_seed(seed)
    return ReferenceVLM(make_config())


def batches(n, batch_size=8, seed=1):
    from dipc.models.data import vlm_batches
    return list(vlm_batches(make_config(), n, batch_size, seed))


def pad(batch, cfg, seq, k_max):
    """A torch-pipelining batch: ``input_ids``/``labels`` right-padded to ``seq``; ``pixel_values`` per sample
    ``[B, k_max, 3, H, W]`` with zero images after the real ones and ``valid [B, k_max]``."""
    ids, labels, pix = batch["input_ids"], batch["labels"], batch["pixel_values"]
    B, S = ids.shape
    T = cfg.tokens_per_image
    out_ids = torch.full((B, seq), cfg.pad_token_id, dtype=ids.dtype)
    out_lab = torch.full((B, seq), -100, dtype=labels.dtype)
    out_ids[:, :S], out_lab[:, :S] = ids, labels
    counts = ((ids == cfg.image_token_id).sum(1) // T).tolist()
    images = torch.zeros(B, k_max, *pix.shape[1:])
    valid = torch.zeros(B, k_max, dtype=torch.bool)
    o = 0
    for b, k in enumerate(counts):
        images[b, :k] = pix[o:o + k]
        valid[b, :k] = True
        o += k
    return {"input_ids": out_ids, "pixel_values": images, "valid": valid, "labels": out_lab}


def unpad(pb):
    """The dipc / unsplit view of a padded batch (the same samples, images and tokens; longer sequences)."""
    return {"input_ids": pb["input_ids"], "pixel_values": pb["pixel_values"][pb["valid"]],
            "labels": pb["labels"]}


class FirstStage(torch.nn.Module):
    """Vision tower + projector + embedding + text layers ``[0, n)`` of ``model``; ``[B, S, D]`` hidden out."""

    def __init__(self, model, n):
        super().__init__()
        self.m, self.n = model, n
        self.vision_tower, self.multi_modal_projector = model.vision_tower, model.multi_modal_projector
        self.embed = model.language_model.embed_tokens
        self.layers = torch.nn.ModuleList(model.language_model.layers[:n])

    def forward(self, input_ids, pixel_values, valid):
        from dipc.models.vlm import scatter_image_features
        B, K = valid.shape
        feats = self.multi_modal_projector(self.vision_tower(pixel_values.flatten(0, 1)))  # padded images too
        feats = feats[valid.flatten()]
        x = scatter_image_features(self.embed(input_ids), input_ids == self.m.config.image_token_id, feats)
        cos, sin = self.m.language_model.rotary_emb(x)
        for layer in self.layers:
            x = layer(x, cos, sin, None)
        return x


class MidStage(torch.nn.Module):
    """Text layers ``[lo, hi)``; the last stage adds the norm and the head (logits out)."""

    def __init__(self, model, lo, hi, last):
        super().__init__()
        self.m, self.last = model, last
        self.layers = torch.nn.ModuleList(model.language_model.layers[lo:hi])
        if last:
            self.norm, self.lm_head = model.language_model.norm, model.lm_head

    def forward(self, x):
        cos, sin = self.m.language_model.rotary_emb(x)
        for layer in self.layers:
            x = layer(x, cos, sin, None)
        return self.lm_head(self.norm(x)) if self.last else x


def loss_fn(logits, labels):
    positions = torch.arange(labels.shape[1])
    targets = torch.roll(labels, shifts=-1, dims=1).masked_fill(positions == labels.shape[1] - 1, -100)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def _torch_rank(rank, world, kind, steps, n_mb, seq, k_max):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    model = make_model()
    cfg = model.config
    bs = [pad(b, cfg, seq, k_max) for b in batches(steps + 1)]
    L = cfg.text.n_layers
    if kind == "1f1b":
        n0 = L // 4
        mods = {0: FirstStage(model, n0), 1: MidStage(model, n0, L, True)}
        mine = [rank]
    else:  # 4 stages, 2 per rank: vision + 1 text layer | 1 | 1 | 1 + head
        cuts = [0, 1, 2, 3, 4] if L == 4 else [0] + [round(L * i / 4) for i in range(1, 5)]
        mods = {0: FirstStage(model, cuts[1])}
        for s in range(1, 4):
            mods[s] = MidStage(model, cuts[s], cuts[s + 1], s == 3)
        mine = [rank, rank + 2]
    stages = [PipelineStage(mods[s], s, len(mods), torch.device("cpu")) for s in mine]
    if kind == "1f1b":
        sched = Schedule1F1B(stages[0], n_mb, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss_fn)
    times, losses_out = [], []
    for i, b in enumerate(bs[1:] + bs[1:2]):  # the first step is a warm-up (shape inference)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t = time.perf_counter()
        losses = []
        if rank == 0:
            sched.step(b["input_ids"], b["pixel_values"], b["valid"], target=b["labels"], losses=losses)
        else:
            sched.step(target=b["labels"], losses=losses)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
        last_rank = (len(mods) - 1) % world
        val = torch.tensor([float(sum(l.item() for l in losses) / max(len(losses), 1)) if rank == last_rank
                            else 0.0])
        dist.all_reduce(val)
        losses_out.append(val.item())
    return {"times": times, "losses": losses_out[:-1]}


def _dipc_rank(rank, world, schedule, steps, n_mb, seq, k_max, padded, b_i):
    import dipc
    model = make_model()
    cfg = model.config
    bs = batches(steps + 1)
    if padded:
        bs = [unpad(pad(b, cfg, seq, k_max)) for b in bs]
    compiled = dipc.compile(model, bs[0], world, sub_microbatch_size={"vision": b_i})
    pipe = compiled.runtime(n_microbatches=n_mb, schedule=schedule)
    times, losses = [], []
    for i, b in enumerate(bs[1:] + bs[1:2]):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = pipe.step(b)
        if i:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return {"times": times, "losses": losses[:-1]}


def _unsplit(steps, seq, k_max, padded):
    model = make_model()
    bs = batches(steps + 1)
    if padded:
        bs = [unpad(pad(b, model.config, seq, k_max)) for b in bs]
    times, losses = [], []
    for b in bs[1:]:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = model(**b)
        loss.backward()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return {"times": times, "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--sub-microbatch", type=int, default=16, help="dipc's B_i (images per sub-microbatch)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dipc.launch import spawn
    cfg = make_config()
    bs = batches(args.steps + 1)
    seq = max(b["input_ids"].shape[1] for b in bs)
    k_max = max(int(((b["input_ids"] == cfg.image_token_id).sum(1) // cfg.tokens_per_image).max()) for b in bs)
    images = [b["pixel_values"].shape[0] for b in bs[1:]]
    padded_images = [len(b["input_ids"]) * k_max for b in bs[1:]]
    rows = []
    torch.set_num_threads(2)
    rows.append(("unsplit, unpadded (2 threads)", _unsplit(args.steps, seq, k_max, False), "the reference"))
    rows.append(("unsplit, padded sequences (2 threads)", _unsplit(args.steps, seq, k_max, True), ""))
    torch.set_num_threads(1)
    for kind in ("1f1b", "interleaved"):
        out = spawn(_torch_rank, 2, args=(kind, args.steps, args.microbatches, seq, k_max), timeout=600)
        name = "Schedule1F1B" if kind == "1f1b" else "ScheduleInterleaved1F1B"
        rows.append((f"torch {name}, padded images and sequences", out[0], "mean of microbatch means"))
    for sched, padded in (("dip", False), ("dip", True), ("1f1b", False)):
        out = spawn(_dipc_rank, 2, args=(sched, args.steps, args.microbatches, seq, k_max, padded,
                                         args.sub_microbatch), timeout=600)
        rows.append((f"dipc {sched}, {'padded sequences' if padded else 'unpadded'}", out[0],
                     "equals unsplit" if not padded else "equals unsplit-padded"))
    ref = statistics.median(rows[0][1]["times"])
    lines = ["# Real execution on 2 CPU ranks: dipc vs torch.distributed.pipelining", "",
             f"Command: `python bench/torch_compare.py --steps {args.steps} --microbatches {args.microbatches} "
             f"--sub-microbatch {args.sub_microbatch}` (dipc's B_i). "
             f"Vision-heavy ReferenceVLM (ViT 6 x 128 on 32 px images, LM 4 x 128), batch size 8, "
             f"{args.microbatches} microbatches; images per batch {images} (padded for torch to "
             f"{padded_images} slots: {k_max} per sample), sequences padded to {seq} tokens for torch. gloo, one "
             "thread per rank; the unsplit runs use 2 threads.", "",
             "| way | step (ms, median) | vs unsplit | losses (first steps) | loss semantics |",
             "|---|---|---|---|---|"]
    for name, r, note in rows:
        med = statistics.median(r["times"])
        lines.append(f"| {name} | {med * 1e3:.1f} | {med / ref:.2f} | "
                     f"{', '.join(f'{x:.4f}' for x in r['losses'][:3])} | {note} |")
    lines += ["", "Tiny models on a 2-core CPU measure overheads as much as compute: compare ratios within this run."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
