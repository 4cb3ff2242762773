from shardwise.sparse_attention.bert import BertSparseSelfAttention

__all__ = ["BertSparseSelfAttention"]
