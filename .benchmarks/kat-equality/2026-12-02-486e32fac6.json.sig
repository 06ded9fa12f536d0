{
  "algorithm": "ed25519",
  "public_key": "WSPG7TSWPEBeV5A69xmoQqWxX8+eW4CMOXwg30gIDYo=",
  "signature": "ps9mBkV+qxsRrlerFAo+cB1T7B+Wb4ETDsvFD60uN/7vDJQsK6G9HEt67C5lcU8g842mGMxTkQQnGyD3uPmOAQ==",
  "file": "2026-12-02-486e32fac6.json"
}
