"""A child process of ``test_cache_hash_seed``: jit each program on a shared disk cache; print, per
program, whether the entry was loaded and whether the result is eager's, bit for bit."""
import json

import torch

import aotgrad

W = {"alpha": 1.0, "beta": 2.0, "gamma": 3.0, "delta": 4.0, "eps": 5.0}
NAMES = set(W)
KEYS = frozenset((n, 1) for n in W)


def held_set(x):
    return torch.stack([x * W[n] for n in NAMES])


def literal_set(x):
    return torch.stack([x * W[n] for n in {"alpha", "beta", "gamma", "delta", "eps"}])


def built_set(x):
    return torch.stack([x * W[n] for n in set(W)])


def tuples_in_a_frozenset(x):
    return torch.stack([x * W[n] * k for n, k in KEYS])


def hashed(x):
    return x * (hash("aotgrad") % 97 + 1)


def addressed(x):
    return x * (id(W) % 97 + 1)


PROCESS_LOCAL = (hashed, addressed)     # never stored on disk


def main():
    x = torch.ones(2)
    out = {}
    for fn in (held_set, literal_set, built_set, tuples_in_a_frozenset, *PROCESS_LOCAL):
        j = aotgrad.jit(fn)
        got = j(x)
        out[fn.__name__] = [j.entries[0].loaded, torch.equal(got, fn(x))]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
