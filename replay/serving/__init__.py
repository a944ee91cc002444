"""Talking to the servers under test.

The SSE decoder, the streaming client and its HTTP/1.1 connections, a streamed answer folded
into its Result (and answers that are not a stream made failed ones), the server's own API
(introspection, the Prometheus scraper, tokenize, prompt log-probabilities), target specs and
the local vLLM servers we start, the KV-cache formats vLLM offers and a served cache read
through its model's layer layout, and the KV-scale log.
"""
