#!/usr/bin/env python3
"""Copy a Llama GGUF with its RoPE stretched to a longer context (NTK-aware
base scaling): <arch>.rope.freq_base becomes base * s^(d / (d - 2)) for
s = new_ctx / <arch>.context_length and d the rotated dimensions, and
<arch>.context_length becomes new_ctx. Both values are patched in place (same
types and sizes), so every tensor and every other byte is unchanged.

The highest-frequency pair keeps its angle per token; the lowest one turns s
times slower, so distances up to new_ctx span the angles that pair saw over
the trained context. Nothing is trained: the result is a model whose position
code reaches new_ctx, for KV-cache quality comparisons at long contexts.

usage: gguf_rope_scale.py IN.gguf OUT.gguf NEW_CTX"""
import struct
import sys

SCALAR = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q', 11: 'q', 12: 'd'}
STRING, ARRAY = 8, 9


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from('<' + fmt, self.data, self.pos)
        self.pos += struct.calcsize('<' + fmt)
        return v[0]

    def string(self):
        n = self.take('Q')
        s = self.data[self.pos:self.pos + n].decode('utf-8')
        self.pos += n
        return s

    def skip_value(self, t):
        if t == STRING:
            self.string()
        elif t == ARRAY:
            item, n = self.take('I'), self.take('Q')
            for _ in range(n):
                self.skip_value(item)
        else:
            self.take(SCALAR[t])


def scalar_values(data):
    """key -> (type, offset of the value) for every scalar metadata value."""
    r = Reader(data)
    if r.take('I') != 0x46554747 or r.take('I') < 2:
        sys.exit('not a GGUF v2/v3 file')
    r.take('Q')
    out = {}
    for _ in range(r.take('Q')):
        key, t = r.string(), r.take('I')
        if t in SCALAR:
            out[key] = (t, r.pos)
        r.skip_value(t)
    return out


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst, new_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = bytearray(open(src, 'rb').read())
    kv = scalar_values(data)
    arch = next(k.split('.')[0] for k in kv if k.endswith('.context_length'))

    def get(key):
        t, off = kv[key]
        return struct.unpack_from('<' + SCALAR[t], data, off)[0]

    def put(key, value):
        t, off = kv[key]
        struct.pack_into('<' + SCALAR[t], data, off, value)

    ctx, base = get(f'{arch}.context_length'), get(f'{arch}.rope.freq_base')
    dims = get(f'{arch}.rope.dimension_count')
    s = new_ctx / ctx
    new_base = base * s ** (dims / (dims - 2))
    put(f'{arch}.context_length', new_ctx)
    put(f'{arch}.rope.freq_base', new_base)
    open(dst, 'wb').write(data)
    print(f'{dst}: context {ctx} -> {new_ctx}, rope.freq_base {base:g} -> {new_base:g} (s = {s:g}, d = {dims})')


if __name__ == '__main__':
    main()
