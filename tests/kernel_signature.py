"""The argument types of a Triton kernel for `triton.compile` (the compile tests' build
scripts, which run in sass_report's worker): constexprs as given, tuple arguments as typed,
pointers as named (other capitalised names bf16 tensors), scalars i32 (fp32 where named)."""


def kernel_signature(fn, cons, pointers=None, fp32_scalars=(), tuples=None):
    sig = {}
    pointers, tuples = pointers or {}, tuples or {}
    for arg in fn.arg_names:
        if arg in cons:
            sig[arg] = "constexpr"
        elif arg in tuples:
            sig[arg] = tuples[arg]
        elif arg in pointers:
            sig[arg] = pointers[arg]
        elif arg[0].isupper():
            sig[arg] = "*bf16"
        else:
            sig[arg] = "fp32" if arg in fp32_scalars else "i32"
    return sig
