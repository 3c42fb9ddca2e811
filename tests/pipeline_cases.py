"""Models and hand-made batches for the multi-process pipeline tests (importable by spawned ranks)."""
import torch

from dipc.models import ReferenceT2V, ReferenceVLM, T2VConfig, VLMConfig
from dipc.models.language import TextConfig
from dipc.models.vlm import VisionConfig


def vlm(tie: bool = False, vision_layers: int = 4, text_layers: int = 4):
    cfg = VLMConfig.tiny(tie_word_embeddings=tie)
    cfg.vision = VisionConfig(image_size=16, patch_size=8, dim=32, n_layers=vision_layers, n_heads=2, ffn_dim=64)
    cfg.text = TextConfig(vocab_size=128, dim=32, n_layers=text_layers, n_heads=4, n_kv_heads=2, ffn_dim=64)
    return ReferenceVLM(cfg)


def vlm_batch(counts, seq, seed, tokens_per_image=4, image_token=127, image_size=16):
    """``len(counts)`` samples of ``seq`` tokens; sample b holds ``counts[b]`` images (placeholders at 1..)."""
    g = torch.Generator().manual_seed(seed)
    B = len(counts)
    ids = torch.randint(3, 120, (B, seq), generator=g)
    for b, k in enumerate(counts):
        assert 1 + k * tokens_per_image < seq
        ids[b, 1:1 + k * tokens_per_image] = image_token
    labels = ids.clone()
    labels[ids == image_token] = -100
    labels[:, -2:] = -100  # some padding-like ignored positions
    return {"input_ids": ids, "pixel_values": torch.randn(sum(counts), 3, image_size, image_size, generator=g),
            "labels": labels}


def vlm_batches_mixed():
    """Example batch, then 4 steps with different sequence lengths; with 2 microbatches each step has a
    microbatch without images (one step has none at all) and most have one whose 3 images form 2 sub-microbatches
    (B_i = 2)."""
    return [vlm_batch([1, 1], 12, 0),
            vlm_batch([2, 1, 0, 0], 20, 1),
            vlm_batch([0, 0, 3, 1], 24, 2),
            vlm_batch([0, 0, 0, 0], 10, 4),  # no image at all: the encoder's gradients are zeros, as unsplit
            vlm_batch([1, 2, 0, 0], 16, 3)]


def vlm_batches_4ranks():
    """4 microbatches per step, image counts per microbatch [3, 0, 1, 2] etc."""
    return [vlm_batch([1, 1], 12, 0),
            vlm_batch([2, 1, 0, 0, 1, 0, 2, 0], 18, 1),
            vlm_batch([0, 0, 3, 1, 0, 1, 0, 0], 22, 2),
            vlm_batch([1, 0, 0, 0, 2, 2, 1, 1], 14, 3)]


def replica_steps():
    """Two steps of two data-parallel replicas' batches, ``[(replica 0's, replica 1's), ...]``: text-only
    microbatches first in one replica and last in the other, a replica without any image in the second step."""
    return [(vlm_batch([0, 0, 2, 1], 16, 10), vlm_batch([1, 2, 0, 0], 16, 11)),
            (vlm_batch([0, 3, 0, 1], 14, 20), vlm_batch([0, 0, 0, 0], 14, 21))]


def adamw_pair(pipe, ref):
    """The same AdamW (lr 1e-2, eps 1e-3) over a pipeline's parameters and over the unsplit reference's."""
    return (torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3),
            torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3))


def t2v():
    return ReferenceT2V(T2VConfig.tiny())


def t2v_batches():
    from dipc.models.data import t2v_batches as gen
    return list(gen(T2VConfig.tiny(), 4, 4, 5))


def llava():
    from dipc.models.hf import tiny_llava
    return tiny_llava(0)


def llava_batches_mixed():
    """LLaVA batches whose microbatches have 0, 1, 2 or 3 images (HF LLaVA fixes the image count at export, so
    each distinct count is re-captured)."""
    from dipc.models.hf import tiny_llava_config
    cfg = tiny_llava_config()
    tpi = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    size = cfg.vision_config.image_size
    mk = lambda counts, seq, seed: vlm_batch(counts, seq, seed, tpi, cfg.image_token_id, size)  # noqa: E731
    return [mk([1, 1], 3 * tpi, 0), mk([2, 1, 0, 0], 4 * tpi, 1), mk([0, 0, 1, 2], 3 * tpi + 2, 2),
            mk([1, 0, 1, 0], 3 * tpi, 3)]


class OutputsVLM(ReferenceVLM):
    """The reference VLM returning a dict of outputs besides the loss, for forward-only evaluation outputs:
    ``logits [B, S, V]``; ``feats [n_images, T, D]`` (the projector's output: empty for a batch without images);
    ``early [n_images, T, Dv]`` (after vision layer 0: computed on rank 0, sent to the last rank); ``masked``
    (logits times the labels' mask: computed from the labels).  Its sequence-length size symbol comes from
    ``labels.shape[1]``, which the labels check must not count as reading the labels."""

    def forward(self, input_ids, pixel_values, labels):
        import torch.nn.functional as F

        from dipc.models.vlm import scatter_image_features

        image_mask = input_ids == self.config.image_token_id
        vt = self.vision_tower
        x = vt.patch_embed(pixel_values).flatten(2).transpose(1, 2) + vt.pos_embed
        x = vt.layers[0](x)
        early = x
        for layer in vt.layers[1:]:
            x = layer(x)
        feats = self.multi_modal_projector(vt.norm(x))
        hidden = self.language_model(inputs_embeds=scatter_image_features(self.language_model.embed_tokens(input_ids),
                                                                          image_mask, feats))
        logits = self.lm_head(hidden)
        positions = torch.arange(labels.shape[1], device=labels.device)
        targets = torch.roll(labels, shifts=-1, dims=1).masked_fill(positions == labels.shape[1] - 1, -100)
        masked = logits * (labels != -100).unsqueeze(-1)
        loss = F.cross_entropy(masked.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits, "feats": feats, "masked": masked, "early": early}


def outputs_vlm():
    cfg = vlm(True).config
    return OutputsVLM(cfg)


class _Repeat(torch.nn.Module):
    """One repeat of :class:`AlbertLike`: the shared block, then this repeat's own LayerNorm."""

    def __init__(self, block, dim):
        super().__init__()
        self.block = block
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, h):
        return self.norm(h + self.block(h))


class AlbertLike(torch.nn.Module):
    """ALBERT-style weight sharing: one ``Sequential(Linear, GELU)`` block applied by every repeat (each with its own
    LayerNorm), the token embedding tied to the output head, ``attention_mask`` as a keyword input.  Cut before
    each repeat on 4 ranks, two weights are tied over different rank sets: the embedding over ranks (0, 3), the
    shared block over (0, 1, 2, 3)."""

    def __init__(self, vocab: int = 64, dim: int = 16, repeats: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        block = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
        self.repeats = torch.nn.ModuleList([_Repeat(block, dim) for _ in range(repeats)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, labels, attention_mask=None):
        h = self.embed(input_ids)
        for r in self.repeats:
            h = r(h)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def albert_like(repeats: int = 4):
    return AlbertLike(repeats=repeats)


def albert_like_batches(samples: int = 4):
    """Example, then 3 steps of ``samples`` samples with different lengths; the mask zeroes a tail of some rows."""
    out = []
    for seed, seq in enumerate((8, 10, 7, 12)):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 64, (samples, seq), generator=g)
        mask = torch.ones(samples, seq, dtype=torch.long)
        mask[seed % samples, seq // 2:] = 0
        out.append({"input_ids": ids, "labels": torch.randint(0, 64, (samples, seq), generator=g),
                    "attention_mask": mask})
    return out


def run_with_strategies(model, c, batch, n_microbatches, strategy):
    """One step of compiled ``c`` on ``batch`` in this process (``dipc.runtime.run_local``) with each forward-backward
    pair at ``strategy(action, layers)`` (``layers``: the fewest layers its chunk runs over the step's captures),
    checked against the unsplit model: loss and every gradient (fp32 rtol 1e-5, atol 1e-6).  Returns ``(workload,
    measured)``: the step's workload and what each forward really kept (``run_local(measure=)``)."""
    import dataclasses

    import dipc
    from dipc.runtime import run_local

    _, plan = dipc.simulate(c, batch, n_microbatches)
    layers = {}  # per chunk, the fewest layers over the captures its microbatches run
    for prog in c.programs:
        for k, cm in prog.chunks.items():
            layers[k] = min(layers.get(k, cm.n_layers), cm.n_layers)
    plan.ranks = [[dataclasses.replace(a, strategy=strategy(a, layers[a.chunk])) if a.kind in ("F", "B") else a
                   for a in acts] for acts in plan.ranks]
    model.zero_grad(set_to_none=True)
    ref = model(**c.batch_spec.eager_view(batch))
    ref = ref if isinstance(ref, torch.Tensor) else ref.loss
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    measured = {}
    loss, _ = run_local(c, batch, n_microbatches, plan, measure=measured)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for k, p in model.named_parameters():
        if k in want:
            torch.testing.assert_close(p.grad, want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    model.zero_grad(set_to_none=True)
    return measured.pop("workload"), measured


def checkpoint_round_trip(rank, pipe, ref, opt, path, rtol, atol):
    """Against the unsplit reference VLM ``ref`` (``vlm(True)``) after the same steps: ``pipe.full_state_dict()``
    equals its state dict within ``rtol``/``atol``; a DCP checkpoint of the pipeline and ``opt`` written at
    ``path`` is read by a fresh unsplit model (``dcp.load(..., no_dist=True)`` on rank 0) to the bit, and loads
    back into the pipeline to the bit after the parameters and AdamW's states moved on (a collective: every rank
    calls it).  Returns the full state dict."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    full = pipe.full_state_dict()
    want = ref.state_dict()
    assert set(full) == set(want)
    for n in want:
        torch.testing.assert_close(full[n], want[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
    pipe.save_checkpoint(path, opt)
    dist.barrier()
    if rank == 0:
        sd = {"model": vlm(True).state_dict()}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        for n in want:
            assert torch.equal(sd["model"][n], full[n]), f"{n} read by the unsplit model"
    snapshot = {n: local(p).clone() for n, p in pipe.named_parameters()}
    moments = {n: local(opt.state[p]["exp_avg"]).clone() for n, p in pipe.named_parameters() if p in opt.state}
    for p in pipe.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    pipe.load_checkpoint(path, opt)
    for n, p in pipe.named_parameters():
        assert torch.equal(local(p), snapshot[n]), f"rank {rank}: {n} after load_checkpoint"
        if n in moments:
            assert torch.equal(local(opt.state[p]["exp_avg"]), moments[n]), f"rank {rank}: {n}'s AdamW state"
    return full
