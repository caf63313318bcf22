"""flash-linear-attention 0.6 refuses its gated chunk_bwd_dqkwg on Hopper under Triton >= 3.4 and < 3.7.1
(fla-org/flash-linear-attention#640: that Triton gives it wrong results) and asks for Triton >= 3.7.1 or
tilelang. The GPU machine has torch 2.11's Triton 3.6, and neither replacement fits what one device call can
carry. With EO_FLA_TIMING_ONLY=1 the refusal is lifted so fla's kernels run and can be timed; their backward's
numbers are then what fla warns about, and the version string every record carries says so."""
import os


def lift_triton_check(version):
    """fla's version, marked when the check was lifted (EO_FLA_TIMING_ONLY=1 and the check present)."""
    if os.environ.get("EO_FLA_TIMING_ONLY") != "1":
        return version
    import fla.ops.common.chunk_o as chunk_o
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return version  # no check here, or a Triton that passes it
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return f"{version} (timing only: its Triton 3.7.1 check lifted, #640)"
