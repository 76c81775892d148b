"""LangChain integration for Kamera (placeholder until implemented)."""
