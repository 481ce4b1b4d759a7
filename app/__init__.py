"""The applications on the public Engine API: OpenAI-compatible server and Gradio UI."""
