"""DAR with distant keys scored in the latent (op family ``"dar_latent"``): ``dar_latent_attention`` is the entry;
the paths are ``dar_latent_attention_reference`` (dense fp32), ``dar_latent_attention_absorbed`` (queries folded
into the latent: decoding), ``dar_latent_attention_rebuilt`` (far keys rebuilt once per call: prefill, training)
and ``dar_latent_attention_fused`` (the same far keys through torch's fused CPU attention: inference prefill);
backend "triton" runs the absorbed decode as a Triton kernel (``allhere.kernels.dar_latent_decode``;
``dispatch.triton_refusal`` says which calls)."""

from .absorbed import dar_latent_attention_absorbed
from .dispatch import dar_latent_attention, dar_latent_attention_torch
from .fused import dar_latent_attention_fused
from .rebuilt import dar_latent_attention_rebuilt
from .reference import dar_latent_attention_reference

__all__ = ["dar_latent_attention", "dar_latent_attention_absorbed", "dar_latent_attention_fused",
           "dar_latent_attention_rebuilt", "dar_latent_attention_reference", "dar_latent_attention_torch"]
