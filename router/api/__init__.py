"""The router's front-ends: OpenAI HTTP and tandem.v1.Router, request bodies, validation, ids, n > 1."""
