"""Print N prompts of random token ids (80..200 long) for a tokenizer-less GGUF, one per line.

usage: prompts.py MODEL_FILE N SEED_STRING
The vocabulary size is the row count of token_embd.weight, found by walking the GGUF header.
"""
import random
import struct
import sys

def n_vocab(path):
    # Minimal GGUF header walk to the tensor infos; returns ne1 of token_embd.weight.
    with open(path, "rb") as f:
        data = f.read(1 << 22)
    off = 4
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, off)
    off += 20
    def rd_str(o):
        (n,) = struct.unpack_from("<Q", data, o)
        return data[o + 8:o + 8 + n].decode(), o + 8 + n
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    def skip_val(t, o):
        if t == 8:
            return rd_str(o)[1]
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, o)
            o += 12
            for _ in range(n):
                o = skip_val(et, o)
            return o
        return o + sizes[t]
    for _ in range(n_kv):
        _, off = rd_str(off)
        (t,) = struct.unpack_from("<I", data, off)
        off = skip_val(t, off + 4)
    for _ in range(n_tensors):
        name, off = rd_str(off)
        (nd,) = struct.unpack_from("<I", data, off)
        dims = struct.unpack_from("<%dQ" % nd, data, off + 4)
        off += 4 + 8 * nd + 4 + 8
        if name == "token_embd.weight":
            return dims[1]
    raise SystemExit("no token_embd.weight")

path, n, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)
v = n_vocab(path)
for _ in range(n):
    length = rng.randint(80, 200)
    print(",".join(str(rng.randrange(v)) for _ in range(length)))
