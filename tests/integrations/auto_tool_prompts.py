"""Requests for measuring `tool_choice="auto"` (docs/langchain.md): 20 a bound tool clearly serves, 20 no bound
tool serves. Written for this measurement; none is taken from LangChain's suite."""

from __future__ import annotations

from langchain_core.tools import tool


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the number."""
    return "42"


@tool
def get_stock_price(ticker: str) -> str:
    """Get the latest stock price for a ticker symbol."""
    return "$123.45"


@tool
def set_timer(minutes: int) -> str:
    """Start a countdown timer for a number of minutes."""
    return "Timer set."


@tool
def send_email(to: str, subject: str, body: str) -> str:
    """Send an email to an address."""
    return "Sent."


@tool
def convert_currency(amount: float, source: str, target: str) -> str:
    """Convert an amount of money from one currency to another."""
    return "91.20"


@tool
def translate(text: str, language: str) -> str:
    """Translate text into another language."""
    return "Bonjour"


W, C, S, T, E, X, L = get_weather, calculator, get_stock_price, set_timer, send_email, convert_currency, translate

#: (tools bound, request, the tool that serves it, a result it might return)
CALL = [
    ([W], "What is the weather in Tokyo right now?", "get_weather", "Rainy, 18 C."),
    ([W], "Is it going to rain in London today?", "get_weather", "Showers, 12 C."),
    ([W, C], "How hot is it in Cairo at the moment?", "get_weather", "Sunny, 35 C."),
    ([W, S], "Check the current weather in Sydney for me.", "get_weather", "Windy, 21 C."),
    ([C], "What is 4817 multiplied by 236?", "calculator", "1136812"),
    ([C, W], "Compute 98765 divided by 43.", "calculator", "2296.86"),
    ([C], "Calculate the square root of 7921.", "calculator", "89"),
    ([C, T], "What is 15% of 2340?", "calculator", "351"),
    ([S], "What is Apple's stock price today?", "get_stock_price", "$189.20"),
    ([S, W], "How much is one share of Tesla (TSLA) trading at?", "get_stock_price", "$251.10"),
    ([S, C], "Look up the current price of MSFT.", "get_stock_price", "$412.00"),
    ([T], "Set a timer for 10 minutes.", "set_timer", "Timer set for 10 minutes."),
    ([T, W], "Start a 25 minute countdown for my pomodoro.", "set_timer", "Timer set for 25 minutes."),
    ([E], "Send an email to bob@example.com saying the meeting moved to 3pm.", "send_email", "Sent."),
    (
        [E, T],
        "Email alice@example.com with the subject 'Lunch' and ask if she is free on Friday.",
        "send_email",
        "Sent.",
    ),
    ([X], "Convert 100 US dollars to euros.", "convert_currency", "92.10 EUR"),
    ([X, C], "How many Japanese yen is 50 British pounds?", "convert_currency", "9,450 JPY"),
    ([L], "Translate 'good morning, my friend' into French.", "translate", "Bonjour, mon ami"),
    (
        [L, W],
        "How do you say 'where is the train station' in Spanish? Use the translation tool.",
        "translate",
        "¿Dónde está la estación de tren?",
    ),
    ([W, C, S], "What's the weather like in Paris today?", "get_weather", "Cloudy, 16 C."),
]

#: (tools bound, a request no bound tool serves)
TEXT = [
    ([W], "Write a haiku about the ocean."),
    ([W], "Hello! How are you today?"),
    ([C], "Who wrote the novel Pride and Prejudice?"),
    ([C, W], "Tell me a short joke about cats."),
    ([S], "What is the capital of Italy?"),
    ([S, C], "Give me three tips for sleeping better."),
    ([T], "What does the word 'ephemeral' mean?"),
    ([T, W], "Explain photosynthesis in one sentence."),
    ([E], "Thank you, that was helpful!"),
    ([E, T], "Can you recommend a good book for a long flight?"),
    ([X], "What colour do you get by mixing blue and yellow?"),
    ([X, C], "Who painted the Mona Lisa?"),
    ([L], "Write a two-line poem about autumn leaves."),
    ([L, W], "What is your name?"),
    ([W, C, S], "Summarise the plot of Romeo and Juliet in one sentence."),
    ([W], "Why is the sky blue?"),
    ([C], "Describe a cat in three words."),
    ([S], "What is the largest planet in the solar system?"),
    ([T], "Goodbye, see you tomorrow!"),
    ([E, L], "What is a good name for a pet goldfish?"),
]

#: the arguments of the call that served each request of ``CALL`` (the history of the turn after the result)
CALL_ARGS: list[dict[str, object]] = [
    {"location": "Tokyo"},
    {"location": "London"},
    {"location": "Cairo"},
    {"location": "Sydney"},
    {"expression": "4817 * 236"},
    {"expression": "98765 / 43"},
    {"expression": "sqrt(7921)"},
    {"expression": "0.15 * 2340"},
    {"ticker": "AAPL"},
    {"ticker": "TSLA"},
    {"ticker": "MSFT"},
    {"minutes": 10},
    {"minutes": 25},
    {"to": "bob@example.com", "subject": "Meeting", "body": "The meeting moved to 3pm."},
    {"to": "alice@example.com", "subject": "Lunch", "body": "Are you free on Friday?"},
    {"amount": 100, "source": "USD", "target": "EUR"},
    {"amount": 50, "source": "GBP", "target": "JPY"},
    {"text": "good morning, my friend", "language": "French"},
    {"text": "where is the train station", "language": "Spanish"},
    {"location": "Paris"},
]
