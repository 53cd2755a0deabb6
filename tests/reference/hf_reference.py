#!/usr/bin/python3
"""Independent reference forward pass for small random LLaMA-family causal LMs.

Purpose
    Produce a Hugging Face style checkpoint (config.json + model.safetensors)
    with small random float32 weights, together with the logits that the
    Hugging Face modeling code (LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM; eager attention) would compute for a
    given token sequence.  The C implementation loads the same checkpoint and
    must reproduce reference_logits.f32 within 1e-4.

    This file is written from the semantics of the Hugging Face modeling code,
    not from the C code.  It needs only the Python standard library and
    PyTorch (no numpy, transformers or safetensors packages).

Usage
    /usr/bin/python3 tests/reference/hf_reference.py \\
        --family FAMILY --out DIR --tokens 1,2,3,... [--seed N]
    /usr/bin/python3 tests/reference/hf_reference.py --self-test

    FAMILY is one of: llama, llama_tied, llama3, mistral, qwen2, qwen3.

    Writes DIR/config.json, DIR/model.safetensors (float32, HF tensor names)
    and DIR/reference_logits.f32 ([n_tokens, vocab_size] float32, little
    endian, row-major), and prints one JSON line:
    {"family", "n_tokens", "vocab_size", "max_abs_logit"}.

    --self-test checks causality for every family, the Mistral sliding window
    (a token just outside the 2-layer receptive field has no effect on the last
    logits, one just inside does), the llama3 frequency scaling, a safetensors
    write/read round trip, and agrees with a second, deliberately naive float64
    implementation (explicit loops over heads, positions and rotary pairs).
"""

import argparse
import array
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "llama_tied", "llama3", "mistral", "qwen2", "qwen3")
DEFAULT_TOKENS = [5, 17, 200, 3, 99, 42, 7, 8, 9, 10, 11, 12]


# ---------------------------------------------------------------------------
# Configurations (real Hugging Face config.json contents)
# ---------------------------------------------------------------------------

def common_config():
    """Fields shared by every family."""
    return {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def family_config(family):
    """The Hugging Face config dict of one family."""
    c = common_config()
    if family in ("llama", "llama_tied", "llama3"):
        c.update({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "eos_token_id": 2,
        })
        if family == "llama_tied":
            c.update({"tie_word_embeddings": True, "eos_token_id": [2, 7]})
        elif family == "llama3":
            c.update({
                "rope_theta": 500000.0,
                "head_dim": 16,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                "tie_word_embeddings": True,
                "eos_token_id": [2, 3],
            })
    elif family == "mistral":
        c.update({
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "rope_theta": 10000.0,
            "sliding_window": 4,
            "tie_word_embeddings": False,
            "eos_token_id": 2,
        })
    elif family == "qwen2":
        c.update({
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "max_window_layers": 2,
            "tie_word_embeddings": True,
            "eos_token_id": 2,
        })
    elif family == "qwen3":
        c.update({
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "head_dim": 32,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
            "tie_word_embeddings": True,
            "eos_token_id": 2,
        })
    else:
        raise ValueError("unknown family %r" % family)
    return c


# ---------------------------------------------------------------------------
# Family differences, one function each
# ---------------------------------------------------------------------------

def head_dim_of(cfg):
    """HF: getattr(config, "head_dim", None) or hidden_size // num_attention_heads."""
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def is_tied(cfg):
    """tie_word_embeddings: logits use model.embed_tokens.weight, no lm_head.weight."""
    return bool(cfg.get("tie_word_embeddings", False))


def has_qkv_bias(cfg):
    """Qwen2 always has q/k/v biases (o_proj none); Llama/Qwen3 via attention_bias."""
    return cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False))


def has_qk_norm(cfg):
    """Qwen3 applies a per-head RMSNorm to queries and keys before rotary."""
    return cfg["model_type"] == "qwen3"


def sliding_window_of(cfg):
    """Window size used by attention, or None for plain causal attention."""
    if cfg["model_type"] == "mistral":
        return cfg.get("sliding_window")
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("use_sliding_window=true is not modelled here")
    return None


def default_inv_freq(base, dim):
    """HF _compute_default_rope_parameters, in float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(inv_freq, rs):
    """HF _compute_llama3_parameters applied to the default inv_freq."""
    factor = rs["factor"]
    low_freq_factor = rs["low_freq_factor"]
    high_freq_factor = rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_inv_freq(cfg):
    """Rotary inverse frequencies for the config (default or llama3 scaling)."""
    inv_freq = default_inv_freq(cfg["rope_theta"], head_dim_of(cfg))
    rs = cfg.get("rope_scaling")
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype != "llama3":
            raise NotImplementedError("rope_type %r" % rtype)
        inv_freq = llama3_inv_freq(inv_freq, rs)
    return inv_freq


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def tensor_shapes(cfg):
    """(name, shape, kind) in a fixed order; kind is 'w', 'b' or 'norm'."""
    v, h, f = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim_of(cfg)
    out = [("model.embed_tokens.weight", [v, h], "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        out.append((p + "input_layernorm.weight", [h], "norm"))
        for proj, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            out.append((p + "self_attn.%s.weight" % proj, [rows, h], "w"))
            if has_qkv_bias(cfg):
                out.append((p + "self_attn.%s.bias" % proj, [rows], "b"))
        out.append((p + "self_attn.o_proj.weight", [h, nh * hd], "w"))
        if has_qk_norm(cfg):
            out.append((p + "self_attn.q_norm.weight", [hd], "norm"))
            out.append((p + "self_attn.k_norm.weight", [hd], "norm"))
        out.append((p + "post_attention_layernorm.weight", [h], "norm"))
        out.append((p + "mlp.gate_proj.weight", [f, h], "w"))
        out.append((p + "mlp.up_proj.weight", [f, h], "w"))
        out.append((p + "mlp.down_proj.weight", [h, f], "w"))
    out.append(("model.norm.weight", [h], "norm"))
    if not is_tied(cfg):
        out.append(("lm_head.weight", [v, h], "w"))
    return out


def init_weights(cfg, seed):
    """Random float32 weights: N(0, 0.02); biases N(0, 0.02); norm gains 1 + N(0, 0.1)."""
    torch.manual_seed(seed)
    weights = {}
    for name, shape, kind in tensor_shapes(cfg):
        t = torch.empty(shape, dtype=torch.float32)
        if kind == "norm":
            t.normal_(0.0, 0.1).add_(1.0)
        else:
            t.normal_(0.0, 0.02)
        weights[name] = t
    return weights


# ---------------------------------------------------------------------------
# Forward pass (HF eager semantics, float32)
# ---------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), in float32."""
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(cfg, n):
    """cos, sin of shape [n, head_dim]; emb = cat(freqs, freqs)."""
    inv_freq = rope_inv_freq(cfg)
    positions = torch.arange(n, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def repeat_kv(x, n_rep):
    """[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d], as HF repeat_kv."""
    b, kvh, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def attention_allowed(n, window):
    """Boolean [n, n]: query i may attend to key j (causal, optional window)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def attention(cfg, w, p, x, cos, sin, allowed):
    n = x.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim_of(cfg)
    bias = has_qkv_bias(cfg)
    q = F.linear(x, w[p + "q_proj.weight"], w[p + "q_proj.bias"] if bias else None)
    k = F.linear(x, w[p + "k_proj.weight"], w[p + "k_proj.bias"] if bias else None)
    v = F.linear(x, w[p + "v_proj.weight"], w[p + "v_proj.bias"] if bias else None)
    q = q.view(1, n, nh, hd)
    k = k.view(1, n, nkv, hd)
    v = v.view(1, n, nkv, hd)
    if has_qk_norm(cfg):
        q = rms_norm(q, w[p + "q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, w[p + "k_norm.weight"], cfg["rms_norm_eps"])
    q = q.transpose(1, 2)  # [1, heads, n, hd]
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    c, s = cos[None, None], sin[None, None]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    k = repeat_kv(k, nh // nkv)
    v = repeat_kv(v, nh // nkv)
    scores = torch.matmul(q, k.transpose(2, 3)) * (hd ** -0.5)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(n, nh * hd)
    return F.linear(out, w[p + "o_proj.weight"])


def mlp(w, p, x):
    gate = F.linear(x, w[p + "gate_proj.weight"])
    up = F.linear(x, w[p + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, w[p + "down_proj.weight"])


def forward(cfg, w, tokens):
    """Logits [n_tokens, vocab_size] float32 for one sequence at positions 0..n-1."""
    n = len(tokens)
    eps = cfg["rms_norm_eps"]
    x = F.embedding(torch.tensor(tokens, dtype=torch.int64), w["model.embed_tokens.weight"])
    cos, sin = rotary_cos_sin(cfg, n)
    allowed = attention_allowed(n, sliding_window_of(cfg))
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        h = x + attention(cfg, w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], eps),
                          cos, sin, allowed)
        x = h + mlp(w, p + "mlp.", rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if is_tied(cfg) else w["lm_head.weight"]
    return F.linear(x, head)


# ---------------------------------------------------------------------------
# Output files
# ---------------------------------------------------------------------------

def f32_bytes(t):
    """Raw little-endian float32 bytes of a tensor, row-major."""
    a = array.array("f", t.detach().to(torch.float32).contiguous().flatten().tolist())
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def write_safetensors(path, tensors):
    """Write {name: float32 tensor} in the safetensors format."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = f32_bytes(t)
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hjson)))
        fh.write(hjson)
        for data in blobs:
            fh.write(data)


def read_safetensors(path):
    """Read a float32 safetensors file back into {name: tensor}; strict checks."""
    with open(path, "rb") as fh:
        raw = fh.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    if hlen % 8 or 8 + hlen > len(raw):
        raise ValueError("bad header length %d" % hlen)
    header = json.loads(raw[8:8 + hlen].decode("utf-8"))
    data = raw[8 + hlen:]
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError("%s: dtype %s" % (name, info["dtype"]))
        begin, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= d
        if end - begin != 4 * numel or end > len(data):
            raise ValueError("%s: bad offsets %r for shape %r" % (name, info["data_offsets"], info["shape"]))
        a = array.array("f")
        a.frombytes(data[begin:end])
        if sys.byteorder != "little":
            a.byteswap()
        out[name] = torch.tensor(a.tolist(), dtype=torch.float32).reshape(info["shape"])
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise ValueError("gap or overlap at byte %d" % begin)
        pos = end
    if pos != len(data):
        raise ValueError("trailing bytes after tensor data")
    return out


def generate(family, out_dir, tokens, seed):
    cfg = family_config(family)
    w = init_weights(cfg, seed)
    with torch.no_grad():
        logits = forward(cfg, w, tokens)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
        fh.write("\n")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), w)
    with open(os.path.join(out_dir, "reference_logits.f32"), "wb") as fh:
        fh.write(f32_bytes(logits))
    return {
        "family": family,
        "n_tokens": len(tokens),
        "vocab_size": cfg["vocab_size"],
        "max_abs_logit": float(logits.abs().max()),
    }


# ---------------------------------------------------------------------------
# Self-test
# ---------------------------------------------------------------------------

def naive_forward(cfg, w, tokens):
    """Slow float64 forward with explicit loops; independent of rotate_half/repeat_kv."""
    W = {k: t.double() for k, t in w.items()}
    n = len(tokens)
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim_of(cfg)
    half = hd // 2
    inv_freq = [float(f) for f in rope_inv_freq(cfg)]  # float32 values, as HF
    window = sliding_window_of(cfg)

    def norm(vec, g):
        ms = sum(float(e) ** 2 for e in vec) / len(vec)
        return vec / math.sqrt(ms + eps) * g

    def rope(vec, pos):
        out = vec.clone()
        for d in range(half):
            ang = float(torch.tensor(float(pos)) * torch.tensor(inv_freq[d]))  # f32 product, as HF
            c, s = math.cos(ang), math.sin(ang)
            out[d] = vec[d] * c - vec[d + half] * s
            out[d + half] = vec[d + half] * c + vec[d] * s
        return out

    x = [W["model.embed_tokens.weight"][t].clone() for t in tokens]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        a = "model.layers.%d.self_attn." % layer
        xn = [norm(r, W[p + "input_layernorm.weight"]) for r in x]
        qs, ks, vs = [], [], []
        for pos in range(n):
            q = W[a + "q_proj.weight"] @ xn[pos]
            k = W[a + "k_proj.weight"] @ xn[pos]
            v = W[a + "v_proj.weight"] @ xn[pos]
            if has_qkv_bias(cfg):
                q, k, v = q + W[a + "q_proj.bias"], k + W[a + "k_proj.bias"], v + W[a + "v_proj.bias"]
            qh = [q[h * hd:(h + 1) * hd] for h in range(nh)]
            kh = [k[h * hd:(h + 1) * hd] for h in range(nkv)]
            if has_qk_norm(cfg):
                qh = [norm(e, W[a + "q_norm.weight"]) for e in qh]
                kh = [norm(e, W[a + "k_norm.weight"]) for e in kh]
            qs.append([rope(e, pos) for e in qh])
            ks.append([rope(e, pos) for e in kh])
            vs.append([v[h * hd:(h + 1) * hd] for h in range(nkv)])
        new_x = []
        for i in range(n):
            heads_out = []
            for h in range(nh):
                g = h // (nh // nkv)  # kv head shared by this query head
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                sc = [float(qs[i][h] @ ks[j][g]) / math.sqrt(hd) for j in keys]
                m = max(sc)
                ex = [math.exp(s - m) for s in sc]
                z = sum(ex)
                o = sum(ex[t] / z * vs[j][g] for t, j in enumerate(keys))
                heads_out.append(o)
            hres = x[i] + W[a + "o_proj.weight"] @ torch.cat(heads_out)
            hn = norm(hres, W[p + "post_attention_layernorm.weight"])
            gate = W[p + "mlp.gate_proj.weight"] @ hn
            up = W[p + "mlp.up_proj.weight"] @ hn
            act = gate / (1.0 + torch.exp(-gate)) * up
            new_x.append(hres + W[p + "mlp.down_proj.weight"] @ act)
        x = new_x
    head = W["model.embed_tokens.weight"] if is_tied(cfg) else W["lm_head.weight"]
    return torch.stack([head @ norm(r, W["model.norm.weight"]) for r in x])


def max_diff(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def self_test():
    failures = []
    tokens = list(DEFAULT_TOKENS)
    n = len(tokens)
    same_tol, change_tol = 1e-6, 1e-5

    def other(t):
        return (t * 37 + 11) % 256 if (t * 37 + 11) % 256 != t else (t + 1) % 256

    for family in FAMILIES:
        cfg = family_config(family)
        w = init_weights(cfg, 1234)
        with torch.no_grad():
            base = forward(cfg, w, tokens)
            # (a) causality: changing tokens after i leaves rows 0..i unchanged
            for i in (0, 4, n - 2):
                changed = tokens[: i + 1] + [other(t) for t in tokens[i + 1:]]
                alt = forward(cfg, w, changed)
                d_prefix = max_diff(base[: i + 1], alt[: i + 1])
                d_after = max_diff(base[i + 1:], alt[i + 1:])
                if d_prefix > same_tol:
                    failures.append("%s: logits at positions <= %d changed by %.3g when later tokens changed"
                                    % (family, i, d_prefix))
                if d_after <= change_tol:
                    failures.append("%s: changing tokens after %d did not change later logits" % (family, i))
            # reference agrees with a naive float64 implementation
            d_naive = max_diff(base, naive_forward(cfg, w, tokens))
            if d_naive > 1e-5:
                failures.append("%s: vectorised and naive forward differ by %.3g" % (family, d_naive))
            # (b) Mistral sliding window: receptive field of the last position
            window = sliding_window_of(cfg)
            if window is not None:
                reach = cfg["num_hidden_layers"] * (window - 1)  # farthest position back that can matter
                last = n - 1
                outside, inside = last - reach - 1, last - reach
                if outside < 0:
                    failures.append("%s: sequence too short for the window test" % family)
                else:
                    for pos, should_change in ((outside, False), (inside, True)):
                        changed = list(tokens)
                        changed[pos] = other(changed[pos])
                        d = max_diff(base[last], forward(cfg, w, changed)[last])
                        if should_change and d <= change_tol:
                            failures.append("%s: token %d back (inside the receptive field) did not change the "
                                            "last logits" % (family, last - pos))
                        if not should_change and d > same_tol:
                            failures.append("%s: token %d back (outside the receptive field) changed the last "
                                            "logits by %.3g" % (family, last - pos, d))
            # llama3: all three branches of the frequency scaling are exercised
            if cfg.get("rope_scaling"):
                plain = default_inv_freq(cfg["rope_theta"], head_dim_of(cfg))
                scaled = rope_inv_freq(cfg)
                ratio = [float(s / p) for s, p in zip(scaled, plain)]
                kept = sum(1 for r in ratio if r == 1.0)
                divided = sum(1 for r in ratio if abs(r - 1.0 / 8.0) < 1e-7)
                medium = len(ratio) - kept - divided
                if not (kept and divided and medium):
                    failures.append("%s: inv_freq ratios %r do not cover kept/medium/divided" % (family, ratio))
        # safetensors round trip
        tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_reference_selftest_%d.safetensors" % os.getpid())
        try:
            write_safetensors(tmp, w)
            back = read_safetensors(tmp)
            if sorted(back) != sorted(w) or any(not torch.equal(back[k], w[k]) for k in w):
                failures.append("%s: safetensors round trip differs" % family)
            if is_tied(cfg) == ("lm_head.weight" in back):
                failures.append("%s: lm_head.weight presence does not match tie_word_embeddings" % family)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    if failures:
        for f in failures:
            print("FAIL: " + f, file=sys.stderr)
        return 1
    print("self-test ok")
    return 0


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def parse_tokens(text, vocab):
    try:
        toks = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise ValueError("--tokens must be comma-separated integers, got %r" % text)
    if not toks:
        raise ValueError("--tokens is empty")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise ValueError("token ids out of range [0, %d): %r" % (vocab, bad))
    return toks


def main(argv):
    ap = argparse.ArgumentParser(description="Hugging Face reference logits for small random LLaMA-family models.")
    ap.add_argument("--family", choices=FAMILIES)
    ap.add_argument("--out", help="output directory (created if missing)")
    ap.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--self-test", action="store_true", help="run internal checks and exit")
    args = ap.parse_args(argv)

    torch.set_default_dtype(torch.float32)
    if args.self_test:
        if args.family or args.out or args.tokens:
            ap.error("--self-test takes no other arguments")
        return self_test()
    missing = [o for o, v in (("--family", args.family), ("--out", args.out), ("--tokens", args.tokens)) if not v]
    if missing:
        ap.error("missing " + ", ".join(missing))
    try:
        tokens = parse_tokens(args.tokens, family_config(args.family)["vocab_size"])
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(generate(args.family, args.out, tokens, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
