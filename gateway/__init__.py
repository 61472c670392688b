"""Starlette gateway: public REST/OpenAI API, tenants, metering, routing (later issues)."""
