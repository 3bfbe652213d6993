"""HTTP API: the shared layer here, one package per protocol (openai/, native/; TEI's routes would
be a tei/ package), each listing its ROUTERS, which app.create_app serves."""
