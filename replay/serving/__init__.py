"""Talking to the servers under test.

The SSE decoder, the streaming client and its HTTP/1.1 connections, the server's own API
(introspection, the Prometheus scraper, tokenize), target specs and the local vLLM servers we
start, and the KV-scale log.
"""
