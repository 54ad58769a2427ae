#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from scratch.

Small, valid-looking inputs the fuzzer mutates from: a tiny GGUF with a SentencePiece vocabulary
and one tensor, protobuf-encoded GenerateRequests, OpenAI JSON bodies and tokenizer texts. The
files are committed; rerun this after changing it (it clears each corpus folder first).
"""
import json
import os
import shutil
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fuzz", "corpus")


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, vtype, payload):
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def tiny_gguf(with_tensor=True, model="llama"):
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>", "\u2581a", "\u2581b", "ab", "\u2581ab", "c"]
    kvs = [
        gguf_kv("general.architecture", 8, gguf_string("llama")),
        gguf_kv("general.alignment", 4, struct.pack("<I", 32)),
        gguf_kv("llama.context_length", 4, struct.pack("<I", 64)),
        gguf_kv("llama.embedding_length", 4, struct.pack("<I", 8)),
        gguf_kv("llama.block_count", 4, struct.pack("<I", 1)),
        gguf_kv("llama.attention.head_count", 4, struct.pack("<I", 2)),
        gguf_kv("tokenizer.ggml.model", 8, gguf_string(model)),
        gguf_kv("tokenizer.ggml.tokens", 9,
                struct.pack("<IQ", 8, len(tokens)) + b"".join(gguf_string(t) for t in tokens)),
        gguf_kv("tokenizer.ggml.scores", 9,
                struct.pack("<IQ", 6, len(tokens)) +
                b"".join(struct.pack("<f", -float(i)) for i in range(len(tokens)))),
        gguf_kv("tokenizer.ggml.token_type", 9,
                struct.pack("<IQ", 5, len(tokens)) +
                struct.pack("<" + "i" * len(tokens), 2, 3, 3, 6, 1, 1, 1, 1, 1)),
        gguf_kv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 1)),
        gguf_kv("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", 2)),
    ]
    tensors = []
    if with_tensor:
        # name, n_dims, dims, type F32 (0), offset 0
        tensors.append(gguf_string("token_embd.weight") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0))
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    if with_tensor:
        out += b"\0" * ((32 - len(out) % 32) % 32)
        out += struct.pack("<8f", *[0.5 * i for i in range(8)])
    return out


def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    return varint((num << 3) | wire) + payload


def ld(num, b):
    return field(num, 2, varint(len(b)) + b)


def sampling(temperature=None, top_k=None, top_p=None, max_tokens=None, stop=(), stop_ids=()):
    b = b""
    if temperature is not None:
        b += field(1, 5, struct.pack("<f", temperature))
    if top_k is not None:
        b += field(2, 0, varint(top_k))
    if top_p is not None:
        b += field(3, 5, struct.pack("<f", top_p))
    if max_tokens is not None:
        b += field(10, 0, varint(max_tokens))
    for i in stop_ids:
        b += field(11, 0, varint(i))
    for s in stop:
        b += ld(12, s.encode())
    return b


def generate_request(request_id="", text=None, ids=None, samp=b""):
    b = b""
    if request_id:
        b += ld(1, request_id.encode())
    if text is not None:
        b += ld(3, text.encode())
    if ids is not None:
        b += ld(4, ld(1, b"".join(varint(i) for i in ids)))  # packed repeated int32
    if samp:
        b += ld(5, samp)
    return b


def write(target, files):
    d = os.path.join(ROOT, target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())


def main():
    write("gguf_fuzz", {
        "tiny_llama": tiny_gguf(),
        "vocab_only": tiny_gguf(with_tensor=False),
        "gpt2_model": tiny_gguf(with_tensor=False, model="gpt2"),
        "truncated": tiny_gguf()[:100],
        "empty": b"",
    })
    texts = ["Hello world", " leading space", "<s> special </s>", "\u00e9t\u00e9 \u2603 \U0001F600",
             "tabs\tand\nnewlines\r\n", "\xff\xfe invalid", "1234567890 3.14", "<|im_start|>user"]
    tok = {}
    for i, t in enumerate(texts):
        raw = t.encode("utf-8", "surrogateescape") if "\xff" not in t else b"\xff\xfe invalid"
        tok["text%d_spm" % i] = bytes([0x0E]) + raw  # spm, add+parse special, special decode
        tok["text%d_bpe" % i] = bytes([0x0F]) + raw  # bpe, same flags
    tok["ids_mod_vocab"] = bytes([0x18]) + bytes(range(0, 64))
    write("tokenizer_fuzz", tok)
    write("generate_request_fuzz", {
        "text": generate_request(text="Once upon a time", samp=sampling(max_tokens=8)),
        "ids": generate_request(request_id="r1", ids=[1, 5, 6, 7],
                                samp=sampling(temperature=0.7, top_k=40, top_p=0.9, max_tokens=4)),
        "stops": generate_request(text="x", samp=sampling(stop=["\n", "end"], stop_ids=[2])),
        "bad_top_p": generate_request(text="x", samp=sampling(top_p=1.5)),
        "bad_id": generate_request(ids=[1, 99999]),
        "empty": b"",
    })
    bodies = {
        "completion": (0, {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
                           "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 3}),
        "completion_ids": (0, {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                               "stream_options": {"include_usage": True}}),
        "completion_vllm": (0, {"prompt": "x", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                "ignore_eos": True, "stop_token_ids": [2]}),
        "chat": (1, {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "hi"}],
                     "max_completion_tokens": 5, "presence_penalty": 0.5}),
        "chat_parts": (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                           "n": 1}),
        "tokenize": (2, {"prompt": "Hello", "add_special_tokens": False}),
        "tokenize_chat": (2, {"messages": [{"role": "user", "content": "hi"}]}),
        "detokenize": (3, {"tokens": [1, 5, 6, 99999]}),
    }
    oa = {name: bytes([k]) + json.dumps(body).encode() for name, (k, body) in bodies.items()}
    oa["not_json"] = b"\x00{\"prompt\": "
    write("openai_request_fuzz", oa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
