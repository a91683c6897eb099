# Sourced by scripts/ncu-compare.sh and scripts/ncu-source.sh: one profiling case
# "impl:mode:d:causal:seqlen" (impl ours or fa4; mode fwd or bwd) read into
# impl, mode, d, causal, seqlen, plus the kernel to profile: ncu's name pattern (pat) and
# how many matching launches to skip (skip: the third repetition's main kernel of
# scripts/profile-target.py; FA4's backward is preprocess, main, postprocess).
read_ncu_case() {
  IFS=: read -r impl mode d causal seqlen <<< "$1"
  skip=2
  if [ "${impl%-aa}" = ours ]; then pat="attn_$mode"; elif [ "$mode" = fwd ]; then pat=Forward; else
    pat=Backward; skip=7
  fi
}
