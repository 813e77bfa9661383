"""flashedu inside other libraries' models: :mod:`flashedu.integrations.transformers` registers
``flashedu.attention`` as an attention implementation of Hugging Face transformers."""
