#!/usr/bin/env node
// Calls pdserve.v1.GenerationService.Generate on a gateway, using nothing but the contract in
// protos/, and prints the completion as one JSON object on stdout:
//
//   {"token_ids": [...], "text": "...", "finish_reason": "FINISH_REASON_LENGTH",
//    "usage": {...}, "num_responses": N}
//
// Usage:
//   node generate.js --address 127.0.0.1:50050 --model demo-llama-v1 --prompt "Hello" \
//     [--max-tokens 16] [--temperature 0] [--top-p P] [--seed S] [--timeout-s 60] [--protos DIR]
//
// Exit status 0 on success; 1 when the call fails: stderr gets one JSON line with the gRPC
// status and the typed pdserve error (the google.rpc.ErrorInfo from the
// grpc-status-details-bin trailer: reason, domain, metadata such as retryScope);
// 2 for bad arguments; 3 when the stream breaks the contract (completion indices not
// consecutive, no finish reason).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

// NOTE: the error model's well-known messages (google/rpc/status.proto and
// error_details.proto), reduced to the fields pdserve sets; field numbers are Google's.
const ERROR_MODEL = protobuf.parse(`
  syntax = "proto3";
  package google.rpc;
  message Any { string type_url = 1; bytes value = 2; }
  message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
  message ErrorInfo { string reason = 1; string domain = 2; map<string, string> metadata = 3; }
  message RetryInfo { Duration retry_delay = 1; }
  message Duration { int64 seconds = 1; int32 nanos = 2; }
`, { keepCase: true }).root;

const USAGE =
  "usage: node generate.js --address HOST:PORT --model NAME --prompt TEXT [--max-tokens N] " +
  "[--temperature T] [--top-p P] [--seed S] [--timeout-s S] [--protos DIR]";

function parseArgs(argv) {
  const args = {
    address: null,
    model: null,
    prompt: null,
    maxTokens: 16,
    temperature: null,
    topP: null,
    seed: null,
    timeoutS: 60,
    protos: path.join(__dirname, "..", "..", "protos"),
  };
  const names = {
    "--address": "address",
    "--model": "model",
    "--prompt": "prompt",
    "--max-tokens": "maxTokens",
    "--temperature": "temperature",
    "--top-p": "topP",
    "--seed": "seed",
    "--timeout-s": "timeoutS",
    "--protos": "protos",
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (key === undefined || i + 1 >= argv.length) {
      throw new Error(`unknown or incomplete argument ${argv[i]}`);
    }
    args[key] = argv[i + 1];
  }
  if (!args.address || !args.model || args.prompt === null) {
    throw new Error("--address, --model and --prompt are required");
  }
  return args;
}

function loadGenerationService(protosDir) {
  // NOTE: includeDirs makes the contract's own imports ("pdserve/v1/common.proto") resolve.
  const definition = protoLoader.loadSync("pdserve/v1/generation.proto", {
    includeDirs: [protosDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const pkg = grpc.loadPackageDefinition(definition);
  return pkg.pdserve.v1.GenerationService;
}

function buildRequest(args) {
  // Fields of pdserve.v1.SamplingParams; unset optional fields take the model's defaults.
  const sampling = { max_tokens: Number(args.maxTokens) };
  if (args.temperature !== null) sampling.temperature = Number(args.temperature);
  if (args.topP !== null) sampling.top_p = Number(args.topP);
  if (args.seed !== null) sampling.seed = String(args.seed);
  return { model: args.model, text: args.prompt, sampling };
}

// The typed error a pdserve server attached to a failed call, or null when there is none.
function pdserveError(metadata) {
  const values = metadata ? metadata.get("grpc-status-details-bin") : [];
  if (!values.length) return null;
  const Status = ERROR_MODEL.lookupType("google.rpc.Status");
  const status = Status.decode(values[0]);
  const typed = {};
  for (const detail of status.details) {
    const name = detail.type_url.slice(detail.type_url.lastIndexOf("/") + 1);
    if (name === "google.rpc.ErrorInfo") {
      const info = ERROR_MODEL.lookupType(name).decode(detail.value);
      Object.assign(typed, { reason: info.reason, domain: info.domain, metadata: info.metadata });
    } else if (name === "google.rpc.RetryInfo") {
      const delay = ERROR_MODEL.lookupType(name).decode(detail.value).retry_delay || {};
      const seconds = typeof delay.seconds === "object" ? delay.seconds.toNumber() : delay.seconds;
      typed.retry_delay_s = Number(seconds || 0) + (delay.nanos || 0) / 1e9;
    }
  }
  return typed;
}

function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
  } catch (error) {
    process.stderr.write(`${error.message}\n${USAGE}\n`);
    process.exit(2);
  }
  const GenerationService = loadGenerationService(args.protos);
  const client = new GenerationService(args.address, grpc.credentials.createInsecure());
  const deadline = new Date(Date.now() + Number(args.timeoutS) * 1000);
  const call = client.Generate(buildRequest(args), { deadline });

  const result = { token_ids: [], text: "", finish_reason: null, usage: null, num_responses: 0 };
  let contractError = null;
  call.on("data", (response) => {
    result.num_responses += 1;
    // Every response's first_index continues where the previous one ended.
    if (response.token_ids.length && response.first_index !== result.token_ids.length) {
      contractError = `first_index ${response.first_index} after ${result.token_ids.length} tokens`;
    }
    result.token_ids.push(...response.token_ids);
    result.text += response.text;
    if (response.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      result.finish_reason = response.finish_reason;
    }
    if (response.usage) result.usage = response.usage;
  });
  call.on("error", (error) => {
    const status = {
      code: grpc.status[error.code] || error.code,
      details: error.details,
      pdserve: pdserveError(error.metadata),
    };
    process.stderr.write(`${JSON.stringify({ error: status })}\n`);
    client.close();
    process.exitCode = 1;
  });
  call.on("end", () => {
    client.close();
    if (process.exitCode === 1) return;
    if (contractError === null && result.finish_reason === null) {
      contractError = "the stream ended without a finish reason";
    }
    if (contractError !== null) {
      process.stderr.write(`${JSON.stringify({ contract_error: contractError })}\n`);
      process.exitCode = 3;
      return;
    }
    process.stdout.write(`${JSON.stringify(result)}\n`);
  });
}

main();
