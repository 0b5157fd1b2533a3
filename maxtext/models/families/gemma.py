"""Gemma (1): the Llama block with Gemma's (1 + s) norm scales, embeddings scaled by sqrt(emb_dim), a GeGLU MLP
(mlp_activations [gelu, linear]: tanh-approximated GELU) and tied embeddings; full attention in every layer, no
post-branch norms, no soft caps (Hugging Face GemmaForCausalLM; MaxText's decoder_block gemma)."""

from maxtext.models.family import Family

FAMILY = Family(name="gemma", hf_model_types=("gemma",), zero_centered_norms=True, scale_embedding=True)
