"""The engine core in a process of its own (as vLLM v1's EngineCore): the API process talks to it over ZMQ."""
