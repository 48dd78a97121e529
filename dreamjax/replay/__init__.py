"""Experience replay: transitions (`transition`), the durable append-only buffer (`buffer`), the encoder phi(s, a)
(`encoder`, `minilm`), exact and ScaNN indexes (`index`), top-k retrieval (`retriever`) and DreamGym's write-back of
synthetic episodes (`write_back`). Nothing is re-exported: import the modules."""
