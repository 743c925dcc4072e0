-- wrk script of bench/bench_proxy.py: POST bodies of ~1 KB, each one distinct, and a one-line JSON summary.
--
--   wrk -t1 -c64 -d5s -s bench/wrk/post.lua http://127.0.0.1:PORT -- ENDPOINT STREAM MAX_TOKENS NONCE MODEL
--     ENDPOINT   generate (SGLang /generate) or chat (/v1/chat/completions)
--     STREAM     1 (SSE) or 0
--     MAX_TOKENS completion length (the sim answers one SSE chunk per token, plus chat's role/finish chunks)
--     NONCE      a string unique to this run, so that no two runs send the same prompt
--     MODEL      the model name of the chat body
--
-- Every prompt is one of 8 shared ~900-character documents (a system prompt, as applications send) followed
-- by a question carrying a request counter: a cache-aware router matches the shared part and inserts the new
-- tail on every request, as in production, rather than finding the same prompt again and again.

local endpoint, stream, max_tokens, nonce, model = "chat", false, 1, "0", "bench-model"
local path = "/v1/chat/completions"
local docs = {}
local counter = 0

local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return string.format("\\u%04x", c:byte()) end) .. '"'
end

function init(args)
  endpoint = args[1] or endpoint
  stream = (args[2] or "0") == "1"
  max_tokens = tonumber(args[3] or "1")
  nonce = args[4] or nonce
  model = args[5] or model
  if endpoint == "generate" then path = "/generate" elseif endpoint ~= "chat" then error("endpoint: " .. endpoint) end
  for i = 1, 8 do
    local parts = { string.format("You are assistant number %d of the benchmark fleet. ", i) }
    for j = 1, 11 do
      parts[#parts + 1] = string.format("Rule %d.%d: answer briefly, cite the document, keep the tone even. ", i, j)
    end
    docs[i] = table.concat(parts)
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  counter = counter + 1
  local doc = docs[(counter % #docs) + 1]
  local question = string.format(
    "Question %s-%d: what does the document above say about item %d, and why does it matter here? Answer in one line.",
    nonce, counter, counter % 97)
  local body
  if endpoint == "generate" then
    body = string.format('{"text":%s,"sampling_params":{"max_new_tokens":%d,"temperature":0},"stream":%s}',
      json_string(doc .. "\n\n" .. question), max_tokens, tostring(stream))
  else
    body = string.format(
      '{"model":%s,"messages":[{"role":"system","content":%s},{"role":"user","content":%s}],'
        .. '"max_tokens":%d,"temperature":0,"stream":%s}',
      json_string(model), json_string(doc), json_string(question), max_tokens, tostring(stream))
  end
  return wrk.format(nil, path, nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d,"mean":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
