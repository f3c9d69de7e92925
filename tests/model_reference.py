"""The model written out from its definitions (docs/METHODS.md §1, §5) in float64, slow and plain.

Each element on its own: the bag-mean embedding, smear position by position, the bigram hash token by token in
int32, RoPE from its frequencies and YaRN's rescales in Python floats, attention as (token, head) pairs that see
(token, head) pairs through a mask built pair by pair, the DC correction over its own 112-key mask, the gate
MLPs' lanes in modded-nanogpt's order, MUDD's coefficients, the sigmoid-capped loss label by label. Nothing here
calls the model's forward or its helpers; tests/test_model.py compares them, logits, loss and every gradient.
"""
import dataclasses
import math

import torch

import conftest
import train_gpt as T

EOT = T.EOT_TOKEN
TINY = conftest.TINY
# 4 heads of 16: a paired layer's RoPE angle (2t + h mod 2) differs from its position (2t + [h >= H/2])
TINY_H4 = dataclasses.replace(TINY, n_head=4, model_dim=64)
# 6 layers with every role moved: no attention in layer 3, paired layers 1 (long) and 4 (long), the key offset
# and DC on the last layer, XSA and output gates in both gate MLPs, 2 VE tables over 3 layers, skip 1 -> 4
MOVED = dataclasses.replace(TINY, n_layer=6, no_attn=(3,), short_window=(0, 2), paired_heads=(1, 4), xsa=(0, 4),
                            attn_gate=(2, 5), dc=(5,), ve_layers=(0, 2, 5), value_embeds=2, skip=(1, 4),
                            attn_state_layer=2, mudd_gates=3)


def config(spec, seq_len=16, **kw):
    """A Config of ``spec``: --model its name in ``conftest.SPECS``, or "test_spec" (a name nothing holds) for a
    spec made here; the caller passes ``spec`` itself to ``T.build_model`` and ``T.Schedule``."""
    name = next((n for n, s in conftest.SPECS.items() if s == spec), "test_spec")
    base = dict(model=name, seq_len=seq_len, batch_tokens=3 * seq_len, val_seq_len=0, val_tokens=3 * seq_len,
                fp8=False)
    return dataclasses.replace(T.Config(), **{**base, **kw})


def random_tokens(shape, seed, p_eot=0.0):
    return conftest.random_tokens(shape, seed, p_eot)


def float64_model(cfg, spec, window, yarn=(), seed=0, tied=True):
    """``T.build_model(cfg, spec)`` in float64, every weight moved off its (often zero or constant) init, at
    ``window`` (long, short) after the long windows ``yarn``, its RoPE tables rebuilt in float64."""
    torch.manual_seed(seed)
    model = T.build_model(cfg, spec).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.6 if name == "lm_head.weight" else 0.4 if p.ndim < 2 or "gate" in name else 0.1
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    model.set_window(window, yarn)
    model.rotary.set_history(yarn)  # float64 tables (built in float32) also without a history
    model.tied = tied
    return model


# ---------------------------------------------------------------------------------------------
# pieces


def rms(x, eps=None):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + (torch.finfo(x.dtype).eps if eps is None else eps))


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def half_freqs(D):
    """Half-truncated RoPE: D/4 frequencies (1/1024)^(i / (D/4 - 1))."""
    return [(1 / 1024) ** (i / (D // 4 - 1)) for i in range(D // 4)]


def ref_yarn(freqs, windows, scale):
    """modded-nanogpt's Yarn.apply (alpha 1, beta 32) at each long-window change old -> new, in Python floats."""
    freqs = list(freqs)
    for old, new in zip(windows, windows[1:]):
        for i, f in enumerate(freqs):
            ramp = min(max((old * f / (2 * math.pi) - 1) / (32 - 1), 0.0), 1.0)
            freqs[i] = f * (old / new + ramp * (1 - old / new))
        scale *= 0.2 * math.log(new / old) + 1
    return freqs, scale


def rope(x, angle, freqs):
    """x [B, L, H, D]: dims (i, i + n) of the first 2n (n = len(freqs)) rotated by angle[t][h] * freqs[i]."""
    n = len(freqs)
    theta = [[[a * f for f in freqs] for a in row] for row in angle]  # [L, H, n], Python floats
    c = torch.tensor([[[math.cos(v) for v in hs] for hs in row] for row in theta], dtype=x.dtype)
    s = torch.tensor([[[math.sin(v) for v in hs] for hs in row] for row in theta], dtype=x.dtype)
    a, b = x[..., :n], x[..., n:2 * n]
    return torch.cat((a * c + b * s, b * c - a * s, x[..., 2 * n:]), -1)


def latent_documents(inputs):
    """[B, L, k] -> per sequence, the document of each latent position: EOTs among the raw tokens up to the last
    token of its bag."""
    B, L, k = inputs.shape
    return [[sum(t == EOT for t in inputs[b].reshape(-1)[:(i + 1) * k].tolist()) for i in range(L)]
            for b in range(B)]


def int32(x):
    """A Python int wrapped to int32 (modded-nanogpt's bigram hash runs in int32)."""
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


def ref_bigram(table, signs, inputs):
    """[B, L, k] -> [B, L, d]: raw token t takes row (36313 c ^ 27191 p) mod (V - 1) of its (previous p, current c)
    pair times sign row (p ^ c) mod 8192; token 0 row V - 1 and sign row 0; position 1 hashes row number V - 1 as
    its previous token, in int32; a latent position the mean over its bag."""
    B, L, k = inputs.shape
    V = table.size(0) - 1
    out = []
    for b in range(B):
        flat = inputs[b].reshape(-1).tolist()
        rows = []
        for t, c in enumerate(flat):
            if t == 0:
                rows.append(table[V] * signs[0])
            else:
                p = flat[t - 1]
                rows.append(table[((36313 * c) ^ int32(27191 * (V if t == 1 else p))) % V] * signs[(p ^ c) % 8192])
        out.append(torch.stack([sum(rows[i * k:(i + 1) * k]) / k for i in range(L)]))
    return torch.stack(out)


def lane_layout(spec):
    """modded-nanogpt's lanes of the two gate MLPs (record #85), ``[[(layer, kind, width)], [...]]``: MLP 0 serves
    layers below mudd_gates, MLP 1 the rest: XSA alphas (n_head per XSA layer), output gates (n_head each), (x0,
    bigram) per attention layer but the last, then (MLP 1) the skip's factor, then DC's w1, w2 (n_head each)."""
    H, G, n = spec.n_head, spec.mudd_gates, spec.n_layer
    out = [[], []]
    for j in (0, 1):
        mine = lambda layers: [i for i in sorted(layers) if (i >= G) == j]  # noqa: E731
        out[j] += [(i, "xsa", H) for i in mine(spec.xsa)] + [(i, "attn", H) for i in mine(spec.attn_gate)]
        for i in mine(i for i in range(n - 1) if i not in spec.no_attn):
            out[j] += [(i, "x0", 1), (i, "bigram", 1)]
    out[1].append((None, "skip", 1))
    for i in sorted(spec.dc):
        out[i >= G] += [(i, "dc1", H), (i, "dc2", H)]
    return out


def ref_gates(P, spec, j, x):
    """Gate MLP j of x [B, L, d]: ``(W2 gelu(W1 x) + b) * scale`` split into its lanes: ({layer: {kind: [B, L, w]}},
    the skip's factor or None)."""
    lanes = lane_layout(spec)[j]
    m = sum(w for *_, w in lanes)
    c = (gelu(x @ P["gate_w1"][j].T) @ P["gate_w2"][j, :m].T + P["gate_b2"][j, :m]) * P["gate_scale"]
    out, skip, at = {}, None, 0
    for layer, kind, w in lanes:
        if kind == "skip":
            skip = c[..., at:at + w]
        else:
            out.setdefault(layer, {})[kind] = c[..., at:at + w]
        at += w
    return out, skip


def ref_mudd(P, j, x, m):
    """MUDD block j (record #81): m coefficients [B, L, 1], ``(W2 gelu(W1 x) + b) * 0.1``."""
    c = (gelu(x @ P["mudd_w1"][j].T) @ P["mudd_w2"][j, :m].T + P["mudd_b2"][j, :m]) * 0.1
    return [c[..., r:r + 1] for r in range(m)]


# ---------------------------------------------------------------------------------------------
# attention


def pair_mask(docs, L, H, paired, window):
    """bool [B, L, H, L, H]: (token t, head h) sees (token s, head g). Plain: g = h, s <= t, t - s <= window.
    Paired (record #58): head h of token t sits at position 2t + [h >= H/2] of stream h mod H/2; a pair sees the
    pairs of its stream at or before its position, at most ``window`` positions back. Always: the same document."""
    B = len(docs)
    pos = (lambda t, h: 2 * t + (h >= H // 2)) if paired else (lambda t, h: t)
    stream = (lambda h: h % (H // 2)) if paired else (lambda h: h)
    return torch.tensor([[[[[stream(g) == stream(h) and 0 <= pos(t, h) - pos(s, g) <= window and d[s] == d[t]
                            for g in range(H)] for s in range(L)] for h in range(H)] for t in range(L)] for d in docs])


def dc_mask(docs, L, window=T.DC_WINDOW):
    """bool [B, L, L]: query t sees key s for 0 <= t - s < 112 in its document (record #85's kernel)."""
    return torch.tensor([[[0 <= t - s < window and d[s] == d[t] for s in range(L)] for t in range(L)] for d in docs])


def softmax_over(scores, mask, dims):
    """softmax of ``scores`` over ``dims`` where ``mask`` (every row has a True entry)."""
    e = torch.where(mask, torch.exp(scores - scores.amax(dim=dims, keepdim=True)), 0.0)
    return e / e.sum(dim=dims, keepdim=True)


def ref_attention(P, spec, i, h, docs, window, freqs, scale, v_add=None, ve_gate=None, lanes=None):
    """Layer i's attention on its normed input h [B, L, d]: q, k, v = h (lam_0 W)^T, v + ve_gate v_add (ve_gate
    None: v + v_add), QK-norm, half RoPE, the key offset (long-window layers that are not paired: a key's last D/2
    dims from the previous token), softmax over the pairs ``pair_mask`` allows, DC's correction, XSA, the output
    gate (per token, from ``lanes``), then (lam_1 W_o)^T."""
    B, L, d = h.shape
    H, D = spec.n_head, spec.head_dim
    lam, w = P[f"blocks.{i}.attn.lambdas"], lambda n: P[f"blocks.{i}.attn.{n}.weight"]  # noqa: E731
    q, k, v = ((h @ (lam[0] * w(n)).T).view(B, L, H, D) for n in "qkv")
    if v_add is not None:
        v_add = v_add.view(B, L, H, D)
        v = v + (ve_gate[..., None] * v_add if ve_gate is not None else v_add)
    paired = i in spec.paired_heads
    angle = [[2 * t + h_ % 2 if paired else t for h_ in range(H)] for t in range(L)]  # modded-nanogpt's paired table
    q, k = rope(rms(q), angle, freqs), rope(rms(k), angle, freqs)
    if not paired and i not in spec.short_window:  # record #49, across documents
        k = torch.cat((k[..., :D // 2], torch.cat((k[:, :1, :, D // 2:], k[:, :-1, :, D // 2:]), 1)), -1)
    allowed = pair_mask(docs, L, H, paired, window)
    a = softmax_over(scale * torch.einsum("bthe,bsge->bthsg", q, k), allowed, (3, 4))
    y = torch.einsum("bthsg,bsge->bthe", a, v)
    lanes = lanes or {}
    if i in spec.dc:  # record #85: mix the heads' softmaxes over the last 112 keys by rms(w1), scale by w2
        near = dc_mask(docs, L)[:, :, None]
        p = softmax_over(scale * torch.einsum("bthe,bshe->bths", q, k), near, (3,))
        mix = torch.einsum("bths,bth->bts", p, rms(lanes["dc1"], 1e-6))
        y = y + lanes["dc2"][..., None] * torch.einsum("bts,bshe->bthe", mix, v)
    if "xsa" in lanes:  # record #82: remove tanh(alpha) of y's part along the token's own v
        along = (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp_min(1e-8)
        y = y - torch.tanh(lanes["xsa"])[..., None] * along * v
    if "attn" in lanes:  # record #28, applied as given (modded-nanogpt)
        y = y * lanes["attn"][..., None]
    return y.reshape(B, L, d) @ (lam[1] * w("proj")).T


def ref_mlp(P, i, h):
    return torch.relu(h @ P[f"blocks.{i}.mlp.fc.weight"].T) ** 2 @ P[f"blocks.{i}.mlp.proj.weight"].T


# ---------------------------------------------------------------------------------------------
# the model


def ref_logits(P, spec, model, inputs, window, yarn, tied=True):
    """Uncapped logits [B, L, V] of inputs [B, L, k] (k = s: TST bags) at ``window`` (long, short) after the long
    windows ``yarn``. ``model``: its bigram sign table only (a random buffer)."""
    n, G, H = spec.n_layer, spec.mudd_gates, spec.n_head
    B, L, k = inputs.shape
    docs = latent_documents(inputs)
    freqs, scale = ref_yarn(half_freqs(spec.head_dim), yarn, spec.attn_scale)
    e = (P["lm_head.weight"] if tied else P["embed.weight"])[inputs].mean(2)
    rows = [e[:, 0]]  # smear (record #34): + lam sigmoid(w . e_t[:12]) e_{t-1}
    for t in range(1, L):
        rows.append(e[:, t] + (P["smear_lambda"] * torch.sigmoid(e[:, t, :12] @ P["smear_w"][0]))[:, None] * e[:, t - 1])
    x0 = rms(torch.stack(rows, 1))
    ves = [P[f"value_embeds.{j}.weight"][inputs].mean(2) for j in range(spec.value_embeds)]
    ve_of = {layer: j % spec.value_embeds for j, layer in enumerate(spec.ve_layers)}
    bigram = ref_bigram(P["bigram.weight"], model.bigram_signs.double(), inputs)
    gates, factor = ref_gates(P, spec, 0, x0)
    x = start = x0 + gates[0]["bigram"] * bigram  # layer 0's bigram enters before the first layer
    after = {}
    for i in range(n):
        if i == G:
            late, factor = ref_gates(P, spec, 1, x)
            gates.update(late)
        if i == spec.skip[1]:
            x = x + torch.sigmoid(P["skip_lambda"]) * factor * after[spec.skip[0]]
        lanes, ve = gates.get(i, {}), ves[ve_of[i]] if i in ve_of else None
        if i < n - 1:
            ra, rm = P[f"blocks.{i}.resid"]
            pa, pm = P[f"blocks.{i}.post"]
            gx, gb, inject = lanes.get("x0"), lanes.get("bigram") if i else None, x0
        if i in spec.no_attn:
            pass
        elif i == n - 1:  # MUDD (record #81 v2): the last layer's V, residual, lambdas and gates per token
            mu = ref_mudd(P, 0, x, 14)
            state = after[spec.attn_state_layer]
            v_add = mu[0] * start + mu[1] * state + mu[2] * x
            if ve is not None:  # heads h < H/2 gated by lane 6, the rest by lane 7
                heads = torch.cat([mu[6 if h < H // 2 else 7] for h in range(H)], -1)
                v_add = v_add + (heads[..., None] * ve.view(B, L, H, -1)).flatten(2)
            x = (1 + mu[5]) * x + mu[3] * start + mu[4] * state
            ra, pa, rm, pm, gx, gb, inject = mu[8], mu[9], mu[12], mu[13], mu[10], mu[11], start
            h = rms(state if spec.attn_state_layer < i else x)
            x = ra * x + pa * ref_attention(P, spec, i, h, docs, window[i in spec.short_window], freqs, scale,
                                            v_add, None, lanes)
        else:
            h = rms(after[spec.attn_state_layer] if spec.attn_state_layer < i else x)  # record #77
            ve_gate = None
            if ve is not None:  # records #55, #70: 2 sigmoid(W [h[:6], ve[:6]]) per head
                ve_gate = 2 * torch.sigmoid(torch.cat((h[..., :6], ve[..., :6]), -1) @ P[f"blocks.{i}.ve_gate"].T)
            x = ra * x + pa * ref_attention(P, spec, i, h, docs, window[i in spec.short_window], freqs, scale, ve,
                                            ve_gate, lanes)
        if i not in spec.no_attn:
            x = x + (gx * inject if gx is not None else 0) + (gb * bigram if gb is not None else 0)
        x = rm * x + pm * ref_mlp(P, i, rms(x))
        after[i] = x
    mu = ref_mudd(P, 1, x, 5)
    x = x + mu[0] * start + mu[1] * after[spec.attn_state_layer] + mu[2] * after[n - 2] + mu[3] * ves[0] \
        + mu[4] * after[spec.skip[0]]
    return rms(x) @ P["lm_head.weight"].T


def capped(logits):
    """Record #54's cap: 23 sigmoid((x + 5) / 7.5)."""
    return 23 * torch.sigmoid((logits + 5) / 7.5)


def ref_loss(logits, targets, weights=None):
    """sum over positions n and valid labels j (>= 0) of w_j (logsumexp(z_n) - z_n[y_nj]), z the capped logits."""
    z = capped(logits).reshape(-1, logits.size(-1))
    y = targets.reshape(-1, targets.size(-1))
    w = torch.ones(y.size(1), dtype=z.dtype) if weights is None else weights
    terms = torch.logsumexp(z, -1, keepdim=True) - z.gather(1, y.clamp_min(0))  # [N, J]: each label's CE
    return torch.where(y >= 0, w * terms, 0.0).sum()
