"""Tokenizers (sentencepiece, Hugging Face, tiktoken) and sentencepiece training."""

from maxtext.tokenizer.tokenizers import HuggingFaceTokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
from maxtext.tokenizer.train import train_sentencepiece

__all__ = ["HuggingFaceTokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "Tokenizer", "load_tokenizer", "train_sentencepiece"]
