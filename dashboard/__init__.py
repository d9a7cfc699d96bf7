"""See a run: `runbus serve` (a JSON API and a web page over the store) and `runbus tail` (live logs).

`api.create_app(store_url, redis_url=None, token=None)` builds the aiohttp application;
`tail.TailSettings` and `tail.tail()` follow a run's streams. Nothing here writes anything.
"""
