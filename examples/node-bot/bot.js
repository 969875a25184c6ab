// A bot tolk did not write the serializer of: one text translated through tolk over Kafka.
//
//   node bot.js "Where is my order?" de en
//
// The request is encoded by @kafkajs/confluent-schema-registry with the id the Schema Registry
// holds under `tolk.requests.<to>-value` (the Confluent wire format), produced to that topic
// with this bot's own reply topic, and the reply is read from it and decoded by the same
// library; the one whose request_id matches is printed as JSON. tolk answers a request in the
// registry's format in the same format (docs/OPERATIONS.md, "Bots in other languages").
//
// Environment: TOLK_BOOTSTRAP (127.0.0.1:9092), TOLK_SCHEMA_REGISTRY_URL
// (http://127.0.0.1:8085/apis/ccompat/v7), TOLK_TOPIC_PREFIX (""), BOT_REPLY_TOPIC
// (<prefix>tolk.replies), BOT_TIMEOUT_MS (60000), BOT_SCHEMA: "registered" (default: the
// subject's latest schema), "v1" (its first version: what `tolk topics create` registered, as
// an older bot still writes), "v2" (registers the latest schema plus channel-field.json first:
// a new optional field, what a newer bot sends), "breaking" (tries to register a schema the
// registry must refuse; prints its reason).
// Exit: 0 OK reply, 1 another status, 2 no reply in time, 3 the registry refused the schema.
'use strict'

const crypto = require('crypto')
const fs = require('fs')
const path = require('path')
const { Kafka, logLevel } = require('kafkajs')
const { SchemaRegistry, SchemaType } = require('@kafkajs/confluent-schema-registry')

const env = process.env
const bootstrap = env.TOLK_BOOTSTRAP || '127.0.0.1:9092'
const registryUrl = env.TOLK_SCHEMA_REGISTRY_URL || 'http://127.0.0.1:8085/apis/ccompat/v7'
const prefix = env.TOLK_TOPIC_PREFIX || ''
const timeoutMs = Number(env.BOT_TIMEOUT_MS || 60000)
const schemaMode = env.BOT_SCHEMA || 'registered'
const [text = 'Where is my order?', to = 'de', from = 'en'] = process.argv.slice(2)

function withOptionalField (schema, field) {
  return { ...schema, fields: [...schema.fields, field] }
}

// The schema id to encode with: the registered one, or a newer schema registered first.
async function requestSchemaId (registry, subject) {
  if (schemaMode === 'registered') return registry.getLatestSchemaId(subject)
  if (schemaMode === 'v1') { // an older bot: the subject's first version
    const answer = await fetch(`${registryUrl.replace(/\/$/, '')}/subjects/${subject}/versions/1`)
    if (!answer.ok) throw new Error(`GET /subjects/${subject}/versions/1: ${answer.status}`)
    return (await answer.json()).id
  }
  const latest = await registry.getLatestSchemaId(subject)
  const answer = await fetch(`${registryUrl.replace(/\/$/, '')}/schemas/ids/${latest}`)
  if (!answer.ok) throw new Error(`GET /schemas/ids/${latest}: ${answer.status}`)
  const base = JSON.parse((await answer.json()).schema)
  const field = schemaMode === 'v2'
    ? JSON.parse(fs.readFileSync(path.join(__dirname, 'channel-field.json'), 'utf8'))
    : { name: 'channel', type: 'string' } // no default: old records cannot be read with it
  const schema = withOptionalField(base, field)
  const { id } = await registry.register(
    { type: SchemaType.AVRO, schema: JSON.stringify(schema) },
    { subject }
  )
  return id
}

async function main () {
  const registry = new SchemaRegistry({ host: registryUrl })
  const kafka = new Kafka({ clientId: 'tolk-node-bot', brokers: [bootstrap], logLevel: logLevel.WARN })
  const requestTopic = `${prefix}tolk.requests.${to}`
  const replyTopic = env.BOT_REPLY_TOPIC || `${prefix}tolk.replies`
  const requestId = crypto.randomUUID()

  let schemaId
  try {
    schemaId = await requestSchemaId(registry, `${requestTopic}-value`)
  } catch (err) {
    console.error(`the registry refused the schema: ${err.message}`)
    return 3
  }

  const consumer = kafka.consumer({ groupId: `tolk-node-bot-${requestId}` })
  const joined = new Promise(resolve => consumer.on(consumer.events.GROUP_JOIN, resolve))
  await consumer.connect()
  await consumer.subscribe({ topic: replyTopic, fromBeginning: false })
  let answer
  const answered = new Promise(resolve => { answer = resolve })
  await consumer.run({
    eachMessage: async ({ message }) => {
      let reply
      try {
        reply = await registry.decode(message.value)
      } catch (err) {
        return // another client's reply in another encoding
      }
      if (reply.request_id === requestId) answer(reply)
    }
  })
  await joined // assigned: a reply produced from now on is read

  const now = Date.now()
  const request = {
    request_id: requestId,
    conversation_id: null,
    source_lang: from,
    target_lang: to,
    text,
    created_at: now,
    deadline: now + timeoutMs,
    reply_topic: replyTopic,
    model_version: null,
    metadata: { bot: 'node' }
  }
  if (schemaMode === 'v2') request.channel = 'chat'
  const producer = kafka.producer()
  await producer.connect()
  await producer.send({
    topic: requestTopic,
    messages: [{ key: requestId, value: await registry.encode(schemaId, request) }]
  })
  await producer.disconnect()

  const timer = new Promise(resolve => setTimeout(() => resolve(null), timeoutMs))
  const reply = await Promise.race([answered, timer])
  await consumer.disconnect()
  if (reply === null) {
    console.error(`no reply to ${requestId} on ${replyTopic} within ${timeoutMs} ms`)
    return 2
  }
  console.log(JSON.stringify({
    request_id: reply.request_id,
    status: reply.status,
    text: reply.text,
    error: reply.error,
    schema_id: schemaId,
    model_version: reply.model_version
  }))
  return reply.status === 'OK' ? 0 : 1
}

main().then(code => process.exit(code), err => {
  console.error(err)
  process.exit(4)
})
