"""HTTP API: app factory + lifespan, routes, schemas, errors, metrics."""
