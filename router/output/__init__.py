"""What the client gets of the tokens: the stop rule, detokenization, stop strings, logprobs."""
