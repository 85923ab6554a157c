"""The global router: OpenAI HTTP and gRPC front-ends, routing policies, detokenization."""
