"""What the Locust adapter (``scenarios/locustfile.py``) needs from replay, without importing
Locust or gevent: load plans, sharding, Locust events from results, the run recorder."""
