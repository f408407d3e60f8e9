"""Building blocks of the decoder: linear layers and their weight formats (`linear_method`),
weight loaders, the logits head, norms, rotary embedding, activations, sampling."""
